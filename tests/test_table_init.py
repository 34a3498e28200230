"""Deferred (meta) tables: rows made chunk by chunk where they live, the same under every strategy."""

from __future__ import annotations

import dataclasses
import functools
import tracemalloc

import lightning.pytorch as pl
import pytest
import torch
from conftest import cpu_trainer, tiny_synthetic
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from lightning_hotcache import HotCacheStrategy, RowWiseOptimizerConfig, progress, table_init
from lightning_hotcache.cache import DeviceCache, HostStore
from lightning_hotcache.cache import device as device_module
from lightning_hotcache.cache import host as host_module
from lightning_hotcache.cache.exchange import RoundRobinRows, RowSharding
from lightning_hotcache.embedding import HotColdEmbeddingBagCollection, hot_cold_modules
from lightning_hotcache.embedding.table_init import deferred_tables_left_out_of_moves, initial_rows, is_deferred, materialize_tables
from models import DLRM
from test_embedding_exactness import TABLES, make_plan, zipf_batches

TABLE = EmbeddingBagConfig(name="t", num_embeddings=1000, embedding_dim=8, feature_names=["f"])


def whole(table: EmbeddingBagConfig, seed: int, chunk_bytes: int) -> torch.Tensor:
    chunks = list(initial_rows(table, seed, chunk_bytes))
    assert [start for start, _ in chunks] == list(range(0, table.num_embeddings, len(chunks[0][1])))
    return torch.cat([rows for _, rows in chunks])


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 16 rows of TABLE (not 131,072), so that its 1,000 rows span many."""
    monkeypatch.setattr(table_init, "BLOCK_VALUES", 16 * TABLE.embedding_dim)


@pytest.mark.usefixtures("small_blocks")
def test_initial_rows_do_not_depend_on_chunking_or_threads_and_leave_the_rng_alone() -> None:
    torch.manual_seed(5)
    before = torch.get_rng_state()
    threads = torch.get_num_threads()
    small, large = whole(TABLE, 3, chunk_bytes=7 * 32), whole(TABLE, 3, chunk_bytes=2**20)
    try:
        torch.set_num_threads(1)
        one_thread = whole(TABLE, 3, chunk_bytes=100 * 32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.get_rng_state(), before)
    assert small.shape == (1000, 8) and torch.equal(small, large) and torch.equal(small, one_thread)
    assert len(list(initial_rows(TABLE, 3, chunk_bytes=7 * 32))) == 63  # chunks of one whole block
    bound = (1 / 1000) ** 0.5  # TorchRec's default init: uniform in +-sqrt(1/num_embeddings)
    assert small.abs().max() <= bound and small.std() > bound / 3
    assert not torch.equal(small, whole(TABLE, 4, chunk_bytes=2**20))
    blocks = small[:992].view(62, 16 * 8)  # every block drew a stream of its own
    assert torch.corrcoef(blocks).fill_diagonal_(0).abs().max() < 0.5


@pytest.mark.usefixtures("small_blocks")
def test_init_fns_without_a_generator_give_the_rows_of_the_parallel_draw() -> None:
    """TorchRec's default init takes a ``generator`` and fills blocks on threads; the same
    draw as a function of the tensor alone runs block by block under the global RNG."""
    bound = (1 / TABLE.num_embeddings) ** 0.5
    serial = dataclasses.replace(TABLE, init_fn=lambda rows: torch.nn.init.uniform_(rows, a=-bound, b=bound))
    assert not table_init._takes_generator(serial.init_fn) and table_init._takes_generator(TABLE.init_fn)
    assert torch.equal(whole(serial, 3, chunk_bytes=2**20), whole(TABLE, 3, chunk_bytes=2**20))


def test_tables_of_one_shape_start_apart() -> None:
    """Each table's name seeds its rows: two tables of one shape (or tables whose bounds only
    differ) do not start as copies of one another, as TorchRec's sequential draws do not."""
    other = dataclasses.replace(TABLE, name="u", feature_names=["g"])
    assert not torch.equal(whole(TABLE, 3, chunk_bytes=2**20), whole(other, 3, chunk_bytes=2**20))
    assert torch.equal(whole(other, 3, chunk_bytes=2**20), whole(other, 3, chunk_bytes=64))


def test_initial_rows_use_the_tables_init_fn() -> None:
    table = EmbeddingBagConfig(
        name="t", num_embeddings=50, embedding_dim=4, feature_names=["f"], init_fn=functools.partial(torch.nn.init.constant_, val=0.5)
    )  # fmt: skip
    assert torch.equal(whole(table, 0, 64), torch.full((50, 4), 0.5))


def test_materialize_allocates_and_initializes_deferred_tables_only() -> None:
    ebc = EmbeddingBagCollection([TABLE], device=torch.device("meta"))
    assert is_deferred(ebc)
    assert materialize_tables(ebc, seed=11)
    assert not is_deferred(ebc) and ebc.device == torch.device("cpu")
    assert torch.equal(ebc.embedding_bags["t"].weight, whole(TABLE, 11, 2**20))
    assert not materialize_tables(ebc, seed=12)  # nothing deferred: untouched
    assert torch.equal(ebc.embedding_bags["t"].weight, whole(TABLE, 11, 2**20))


def test_large_tables_show_progress_while_drawn(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    materialize_tables(EmbeddingBagCollection([TABLE], device=torch.device("meta")), seed=1)
    assert "initializing tables" not in capsys.readouterr().err  # 32 KB: no bar
    monkeypatch.setattr(progress, "PROGRESS_FROM_BYTES", 4 * 1000 * 8)
    ebc = EmbeddingBagCollection([TABLE], device=torch.device("meta"))
    materialize_tables(ebc, seed=1)
    assert "initializing tables" in capsys.readouterr().err
    assert torch.equal(ebc.embedding_bags["t"].weight, whole(TABLE, 1, 2**20))


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_load_rows_keeps_this_ranks_shard_and_refreshes_cached_rows(rank: int) -> None:
    rows = torch.arange(1000 * 8, dtype=torch.float32).view(1000, 8)
    sharding = RowSharding(rank, 3)
    host = HostStore("t", sharding.num_local(1000), 8, {})
    static = torch.tensor([0, 7, 500, 999])
    cache = DeviceCache("t", 1000, 8, RowWiseOptimizerConfig(), static, 16, "lfu", host, torch.device("cpu"), sharding)
    for start in range(0, 1000, 137):  # chunks that start on every rank's rows
        cache.load_rows("weight", start, rows[start : start + 137])
    assert torch.equal(host.weight, rows[rank::3])
    assert torch.equal(cache.weight[: len(static)], rows[static])
    with pytest.raises(ValueError, match="has shape"):
        cache.load_full("weight", rows[:10])


@pytest.mark.parametrize(
    ("rank", "world", "saved"),
    [(0, 1, None), (1, 3, None), (0, 1, 1), (1, 2, 2), (2, 3, 2), (0, 1, 3)],
    ids=["whole", "whole-across-ranks", "pieces", "pieces-as-saved", "pieces-resharded", "pieces-to-one"],
)
@pytest.mark.parametrize("identity", [False, True], ids=["split", "on-device"])
def test_a_load_reports_every_byte_it_writes_here(rank: int, world: int, saved: int | None, identity: bool, monkeypatch) -> None:
    # What a restore's progress bar counts (`restored_bytes` is its total): this rank's rows
    # of a split table chunk by chunk (chunks of 100 rows here), the whole of one wholly on the device.
    monkeypatch.setattr(host_module, "CHUNK_BYTES", 100 * 8 * 4)
    monkeypatch.setattr(device_module, "_PIECE_ROWS", 100)
    rows = torch.arange(1000 * 8, dtype=torch.float32).view(1000, 8)
    sharding = RowSharding(rank, world)
    host = None if identity else HostStore("t", sharding.num_local(1000), 8, {})
    static = torch.arange(1000) if identity else torch.tensor([0, 7, 500, 999])
    cache = DeviceCache("t", 1000, 8, RowWiseOptimizerConfig(), static, 0 if identity else 16, "lfu", host, torch.device("cpu"), sharding)
    reported: list[int] = []
    values = rows if saved is None else RoundRobinRows(tuple(rows[s::saved] for s in range(saved)))
    cache.load_full("weight", values, reported.append)
    assert sum(reported) == cache.restored_bytes("weight") == (1000 if identity else sharding.num_local(1000)) * 8 * 4
    assert torch.equal(cache.slots["weight"] if identity else host.weight, rows if identity else rows[rank::world])
    assert len(reported) == 1 if identity else len(reported) > 1


@pytest.mark.parametrize("storage", ["memory", "mmap"])
def test_hot_cold_collection_initializes_deferred_tables_in_its_tiers(storage: str, tmp_path) -> None:
    plan = make_plan(zipf_batches(), 0.05, 1, "lfu")
    assert any(not p.on_device for p in plan.tables)  # some tables are split
    meta = EmbeddingBagCollection(TABLES, device=torch.device("meta"))
    module = HotColdEmbeddingBagCollection.from_ebc(
        meta, plan, host_storage="memory" if storage == "memory" else tmp_path, seed=9
    )  # fmt: skip
    state = module.state_dict()
    for table in TABLES:
        assert torch.equal(state[f"embedding_bags.{table.name}.weight"], whole(table, 9, 2**20)), table.name


def test_split_tables_are_made_in_place_in_their_host_stores_in_one_process() -> None:
    plan = make_plan(zipf_batches(), 0.05, 1, "lfu")
    module = HotColdEmbeddingBagCollection.from_ebc(EmbeddingBagCollection(TABLES, device=torch.device("meta")), plan, seed=9)
    split = [t for t in TABLES if not module.caches[t.name].identity]
    assert split
    for table in split:
        cache = module.caches[table.name]
        at = cache.initial_rows_at("weight")
        assert at is not None
        for start, rows in initial_rows(table, 9, chunk_bytes=64 * 4 * table.embedding_dim, into=at):
            assert rows.data_ptr() == cache.host.weight[start].data_ptr()  # in the store, no copy
        assert torch.equal(cache.host.weight, whole(table, 9, 2**20)), table.name
    host = HostStore("t", 500, 8, {})
    sharded = DeviceCache("t", 1000, 8, RowWiseOptimizerConfig(), torch.tensor([0]), 16, "lfu", host, torch.device("cpu"), RowSharding(0, 2))
    assert sharded.initial_rows_at("weight") is None  # a shard holds every other row: copied in


def test_declaring_tables_far_larger_than_ram_takes_no_memory() -> None:
    huge = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=10**9, embedding_dim=128, feature_names=[f"f{i}"]) for i in range(4)
    ]  # 2 TB of rows
    tracemalloc.start()
    model = DLRM(huge, 13, defer_table_init=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 50 * 2**20
    assert all(p.is_meta for p in model.sparse_arch.parameters())


def test_moves_leave_deferred_tables_alone_only_within_the_context() -> None:
    model = _deferred_model(tiny_synthetic(scale=0.01, num_embeddings_cap=None, num_train_samples=64, batch_size=64))
    with deferred_tables_left_out_of_moves(model):
        model.cpu().double()
    assert all(p.is_meta for p in model.sparse_arch.parameters())
    assert all(p.dtype == torch.float64 for p in model.dense_arch.parameters())  # the rest did move
    with pytest.raises(NotImplementedError, match="meta"):
        model.cpu()  # restored: an ordinary move copies (and a meta tensor has nothing to copy)


def test_deferred_model_with_a_budget_the_planner_refuses_fails_with_the_planners_error() -> None:
    # Lightning's teardown after the failed setup moved the still-meta tables to the CPU, which
    # raised "Cannot copy out of meta tensor" during handling of the planner's error.
    dm = tiny_synthetic(scale=0.01, num_embeddings_cap=None, num_train_samples=256, batch_size=64)
    model = _deferred_model(dm)
    trainer = cpu_trainer(strategy=HotCacheStrategy(device_budget=1000, profile_batches=2), max_epochs=1, limit_val_batches=0)
    with pytest.raises(ValueError, match="cannot train these tables") as raised:
        trainer.fit(model, dm)
    assert raised.value.__context__ is None  # not raised while handling another error (e.g. the stats the plan needed)
    assert all(p.is_meta for p in model.sparse_arch.parameters())  # nothing allocated


def _fit(strategy, tmp_path=None) -> tuple[DLRM, pl.Trainer]:
    pl.seed_everything(0)
    dm = tiny_synthetic(scale=0.01, num_embeddings_cap=None, num_train_samples=512, batch_size=64)
    model = DLRM(dm.tables, dm.num_dense_features, defer_table_init=True, embedding_optimizer={"name": "rowwise_adagrad"})
    trainer = cpu_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0, enable_checkpointing=tmp_path is not None,
                          default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, dm)
    return model, trainer


def test_deferred_model_learns_the_same_under_auto_and_hotcache_from_mmap(tmp_path) -> None:
    auto, _ = _fit("auto")
    assert not any(p.is_meta for p in auto.parameters())
    hot, trainer = _fit(HotCacheStrategy(device_budget=0.1, host_storage=str(tmp_path / "rows"), profile_batches=4), tmp_path)
    module = next(iter(hot_cold_modules(hot).values()))
    assert any(not cache.identity for cache in module.caches.values())  # rows really live in mmap files
    expected, got = auto.state_dict(), hot.state_dict()
    assert expected.keys() == got.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-5, msg=key)
    # A checkpoint of the deferred model loads back into a deferred model.
    path = trainer.checkpoint_callback.best_model_path
    loaded = DLRM.load_from_checkpoint(path, weights_only=True)
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, got[key], rtol=0, atol=0, msg=key)


def _deferred_model(dm) -> DLRM:
    return DLRM(dm.tables, dm.num_dense_features, defer_table_init=True, embedding_optimizer={"name": "rowwise_adagrad"})


@pytest.mark.parametrize("stage", ["validate", "fit"])
def test_deferred_model_under_hotcache_restores_its_trained_tables_from_a_checkpoint(stage: str, tmp_path) -> None:
    # Lightning restores a checkpoint before the strategy's setup, while deferred tables are still
    # on the meta device: loading rows into them did nothing, and the install then drew fresh rows.
    hot, trainer = _fit(HotCacheStrategy(device_budget=0.1, profile_batches=4), tmp_path)
    path = trainer.checkpoint_callback.best_model_path
    saved = torch.load(path, weights_only=False)["state_dict"]
    pl.seed_everything(1)  # another seed: fresh tables would differ from the trained ones
    dm = tiny_synthetic(scale=0.01, num_embeddings_cap=None, num_train_samples=512, batch_size=64)
    model = _deferred_model(dm)
    strategy = HotCacheStrategy(device_budget=0.1, profile_batches=4)
    if stage == "validate":
        cpu_trainer(strategy=strategy).validate(model, dm, ckpt_path=path)
    else:  # resumed at the end of its epoch: nothing left to train, the tables as saved
        cpu_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0).fit(model, dm, ckpt_path=path)
    got = model.state_dict()
    tables = [k for k in saved if "embedding_bags" in k]
    assert tables
    for key in saved:
        torch.testing.assert_close(got[key], saved[key], rtol=0, atol=0, msg=key)
