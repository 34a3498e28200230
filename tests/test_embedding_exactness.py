"""HotColdEmbeddingBagCollection learns exactly what torchrec's EmbeddingBagCollection learns.

Reference: torchrec's EBC (sparse bags) trained with the same row-wise rule through
TorchRec's in-backward optimizer. Swept: budgets, cache policies, optimizers, host storage,
prefetch depth and kernel (FBGEMM's fused TBE, PyTorch's embedding_bag); compared: tables
and per-row optimizer state after N steps.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from conftest import exactness_matrix

from lightning_hotcache import RowWiseOptimizer, RowWiseOptimizerConfig, use_sparse_gradients
from lightning_hotcache.cache.exchange import RowSharding
from lightning_hotcache.embedding import HotColdEmbeddingBagCollection
from lightning_hotcache.embedding.update import OwnersUpdate
from lightning_hotcache.planner.plan import HotColdPlan, TablePlan

TABLES = [
    EmbeddingBagConfig(name="t_user", num_embeddings=1500, embedding_dim=8, feature_names=["user"]),
    EmbeddingBagConfig(name="t_item", num_embeddings=700, embedding_dim=4, feature_names=["item", "item_hist"]),
    EmbeddingBagConfig(name="t_tag", num_embeddings=90, embedding_dim=8, feature_names=["tag"], pooling=PoolingType.MEAN),
]
STEPS, BATCH = 8, 32


def zipf_batches(steps: int = STEPS, seed: int = 0, weighted: bool = False, extra: dict[str, int] | None = None) -> list[KeyedJaggedTensor]:
    """Zipf-skewed batches of TABLES' features (and ``extra`` features: name -> rows)."""
    rng = np.random.default_rng(seed)
    rows = {"user": 1500, "item": 700, "item_hist": 700, "tag": 90, **(extra or {})}
    perm = {f: rng.permutation(n) for f, n in rows.items()}  # hot ids scattered
    batches = []
    for _ in range(steps):
        values, lengths = [], []
        for feature, n in rows.items():
            bag = 1 if feature in ("user", "item") else 3
            length = rng.integers(0 if bag > 1 else 1, bag + 1, BATCH)
            ranks = np.minimum(rng.zipf(1.2, int(length.sum())) - 1, n - 1)
            values.append(perm[feature][ranks])
            lengths.append(length)
        v = torch.from_numpy(np.concatenate(values))
        w = torch.from_numpy(rng.uniform(0.5, 1.5, len(v)).astype(np.float32)) if weighted else None
        batches.append(
            KeyedJaggedTensor.from_lengths_sync(
                keys=list(rows), values=v, lengths=torch.from_numpy(np.concatenate(lengths)).int(), weights=w
            )
        )
    return batches


SUM_TABLES = [EmbeddingBagConfig(**{**t.__dict__, "pooling": PoolingType.SUM}) for t in TABLES]
# FBGEMM's TBE has one pooling mode for all its tables: the fused path is swept on SUM tables.
# Triton's kernels run in its interpreter on a CPU (TRITON_INTERPRET=1, set by conftest): a
# program at a time, so by default over the factors that change what its kernels see.
KERNEL_TABLES = {"fbgemm": SUM_TABLES, "pytorch": TABLES, "triton": TABLES}


def make_plan(batches, fraction: float | None, depth: int, policy: str, tables=TABLES) -> HotColdPlan:
    """fraction: share of each table's rows kept static (hottest first); None: the minimum (no static rows)."""
    plans = []
    for table in tables:
        ids = [torch.cat([b[f].values() for f in table.feature_names]) for b in batches]
        counts = torch.bincount(torch.cat(ids), minlength=table.num_embeddings)
        max_unique = max(len(i.unique()) for i in ids)
        k = 0 if fraction is None else int(fraction * table.num_embeddings)
        static = torch.argsort(counts, descending=True, stable=True)[:k].numpy()
        slots = (depth + 1) * max_unique
        plans.append(TablePlan(table.name, table.num_embeddings, table.embedding_dim, static, slots, 0, 0.0))
    return HotColdPlan(plans, budget_bytes=1, prefetch_depth=depth, cache_policy=policy, lookahead_batches=LOOKAHEAD if policy == "lookahead" else 0)


def train_reference(config: RowWiseOptimizerConfig, batches, upstream, tables=TABLES, weighted=False) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=weighted)
    apply_optimizer_in_backward(RowWiseOptimizer, use_sparse_gradients(ebc), {"config": config})
    for batch, grad in zip(batches, upstream):
        ebc(batch).values().backward(grad)
    return ebc


def train_hotcache(
    config, batches, upstream, plan, policy, host_storage, depth, tables=TABLES, weighted=False, kernel="auto", reads_sorted_on_device=False,
    staging_threads=1,
):  # fmt: skip
    torch.manual_seed(0)
    module = HotColdEmbeddingBagCollection.from_ebc(
        EmbeddingBagCollection(tables=tables, is_weighted=weighted), plan, config, cache_policy=policy,
        host_storage=host_storage, kernel=kernel, staging_threads=staging_threads,
    )  # fmt: skip
    if reads_sorted_on_device:  # what the PyTorch path does on CUDA, here on the CPU
        assert module._staging.sums_gradients
        module._staging.sorts_reads_on_device = True
    # Under the lookahead policy the batches are announced LOOKAHEAD ahead of their staging, as
    # the strategy's loader does.
    lookahead = LOOKAHEAD if policy == "lookahead" and depth else 0
    staged = announced = 0
    for step, (batch, grad) in enumerate(zip(batches, upstream)):
        while depth and staged <= min(step + depth, len(batches) - 1):
            while lookahead and announced <= min(staged + lookahead, len(batches) - 1):
                module.announce(batches[announced])
                announced += 1
            module.prefetch(batches[staged], announced=bool(lookahead))
            staged += 1
        module(batch).values().backward(grad)
    return module


def assert_same(module: HotColdEmbeddingBagCollection, reference: EmbeddingBagCollection) -> None:
    torch.testing.assert_close(module.state_dict(), reference.state_dict(), rtol=1e-5, atol=1e-6)
    expected = reference_state(reference)
    for name, arrays in module.optimizer_state().items():
        for key, value in arrays.items():
            torch.testing.assert_close(value, expected[name][key], rtol=1e-5, atol=1e-6, msg=f"{name}.{key}")


def reference_state(ebc: EmbeddingBagCollection) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name, bag in ebc.embedding_bags.items():
        optimizer = bag.weight._in_backward_optimizers[0]
        out[name] = dict(optimizer.state[bag.weight])
    return out


LOOKAHEAD = 3  # batches announced ahead of staging under the lookahead policy
UPSTREAM = [torch.randn(BATCH, 8 + 4 + 4 + 8, generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]
BUDGETS = {"100%": 1.0, "10%": 0.1, "1%": 0.01, "minimum": None}
POLICIES = ["static", "lru", "lfu", "lookahead"]
NAMES = ["budget", "policy", "optimizer", "storage", "depth", "kernel"]
OPTIMIZERS = ["sgd", "rowwise_adagrad", "adam"]
CASES = exactness_matrix(
    NAMES,
    together={"budget": list(BUDGETS), "policy": POLICIES, "depth": [0, 2]},
    apart={"optimizer": OPTIMIZERS, "storage": ["memory", "mmap"], "kernel": ["fbgemm", "pytorch"]},
) + exactness_matrix(
    NAMES,
    together={"budget": ["10%", "minimum"], "policy": ["lfu", "lookahead"], "kernel": ["triton"]},
    apart={"optimizer": OPTIMIZERS, "storage": ["memory", "mmap"], "depth": [0, 2]},
)
FUSED_OPTIMIZERS = ("sgd", "rowwise_adagrad")  # FBGEMM's Adam is not the library's lazy Adam


@pytest.mark.parametrize(("budget", "policy", "optimizer", "storage", "depth", "kernel"), CASES)
def test_same_tables_and_state_as_torchrec(budget, policy, optimizer, storage, depth, kernel, tmp_path) -> None:
    config = RowWiseOptimizerConfig(name=optimizer, lr=0.05)
    tables = KERNEL_TABLES[kernel]
    batches = zipf_batches()
    plan = make_plan(batches, BUDGETS[budget], depth, policy, tables)
    reference = train_reference(config, batches, UPSTREAM, tables)
    storage_path = "memory" if storage == "memory" else tmp_path
    chosen = "pytorch" if kernel == "fbgemm" and optimizer not in FUSED_OPTIMIZERS else kernel  # FBGEMM has no lazy Adam
    module = train_hotcache(config, batches, UPSTREAM, plan, policy, storage_path, depth, tables, kernel=chosen)
    assert module.kernel_note.startswith(chosen), module.kernel_note
    assert_same(module, reference)
    if policy == "lookahead" and depth and storage == "mmap" and budget != "100%":
        assert sum(c.counters.read_ahead_rows for c in module.caches.values()) > 0  # its misses were read ahead
    if budget == "minimum":
        counters = module.caches["t_user"].counters
        assert counters.evicted_rows > 0 and counters.fetched_rows > 0  # the cache really cycled


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("budget", ["10%", "minimum"])
def test_reads_sorted_on_the_device_learn_what_torchrec_learns(budget, optimizer, weighted) -> None:
    # On CUDA the PyTorch path finds each device table's reads on the device: every value's
    # row sorted, repeats kept (`sorted_reads`); each repeat steps to the same values.
    config = RowWiseOptimizerConfig(name=optimizer, lr=0.05)
    tables = SUM_TABLES if weighted else TABLES  # embedding_bag weighs SUM bags only
    batches = zipf_batches(weighted=weighted, seed=5)
    plan = make_plan(batches, BUDGETS[budget], 2, "lfu", tables)
    reference = train_reference(config, batches, UPSTREAM, tables, weighted=weighted)
    module = train_hotcache(
        config, batches, UPSTREAM, plan, "lfu", "memory", 2, tables, weighted=weighted, kernel="pytorch", reads_sorted_on_device=True
    )
    assert_same(module, reference)


@pytest.mark.parametrize("depth", [0, 2])
def test_per_sample_weights(depth: int) -> None:
    config = RowWiseOptimizerConfig(name="rowwise_adagrad", lr=0.05)
    batches = zipf_batches(weighted=True, seed=3)
    plan = make_plan(batches, 0.05, depth, "lru", tables=SUM_TABLES)
    reference = train_reference(config, batches, UPSTREAM, tables=SUM_TABLES, weighted=True)
    module = train_hotcache(config, batches, UPSTREAM, plan, "lru", "memory", depth, tables=SUM_TABLES, weighted=True, kernel="fbgemm")
    assert module.kernel_note.startswith("fbgemm")
    assert_same(module, reference)


@pytest.mark.parametrize("optimizer", FUSED_OPTIMIZERS)
def test_fused_kernel_learns_what_the_pytorch_path_learns(optimizer) -> None:
    config = RowWiseOptimizerConfig(name=optimizer, lr=0.05)
    batches = zipf_batches(seed=5)
    plan = make_plan(batches, 0.1, 1, "lfu", SUM_TABLES)
    fused, plain = (train_hotcache(config, batches, UPSTREAM, plan, "lfu", "memory", 1, SUM_TABLES, kernel=k) for k in ("fbgemm", "pytorch"))
    assert fused.kernel_note.startswith("fbgemm") and plain.kernel_note.startswith("pytorch")
    torch.testing.assert_close(fused.state_dict(), plain.state_dict(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.optimizer_state(), plain.optimizer_state(), rtol=1e-5, atol=1e-6)


def test_fused_kernel_refused_where_it_would_not_be_exact() -> None:
    batches = zipf_batches(steps=1)
    with pytest.raises(ValueError, match="one pooling mode"):
        train_hotcache(RowWiseOptimizerConfig("sgd"), batches, UPSTREAM, make_plan(batches, 0.1, 0, "lfu"), "lfu", "memory", 0, kernel="fbgemm")
    plan = make_plan(batches, 0.1, 0, "lfu", SUM_TABLES)
    with pytest.raises(ValueError, match="Adam"):
        train_hotcache(RowWiseOptimizerConfig("adam"), batches, UPSTREAM, plan, "lfu", "memory", 0, SUM_TABLES, kernel="fbgemm")


def test_dims_fbgemm_cannot_take_fall_back_to_pytorch() -> None:
    # FBGEMM's TBE asserts on widths that are not multiples of 4: "auto" must not reach it.
    tables = [EmbeddingBagConfig(name="narrow", embedding_dim=2, num_embeddings=10, feature_names=["f"])]
    plan = HotColdPlan([TablePlan("narrow", 10, 2, np.arange(10), 0, 80, 1.0)], 80)
    module = HotColdEmbeddingBagCollection.from_ebc(EmbeddingBagCollection(tables=tables), plan)
    assert module.kernel_note.startswith("pytorch") and "multiples of 4" in module.kernel_note, module.kernel_note
    with pytest.raises(ValueError, match="multiples of 4 .*narrow"):
        HotColdEmbeddingBagCollection.from_ebc(EmbeddingBagCollection(tables=tables), plan, kernel="fbgemm")


@pytest.mark.parametrize(("optimizer", "chosen"), [("rowwise_adagrad", "pytorch"), ("sgd", "fbgemm")])
def test_auto_kernel_on_a_cpu_is_the_faster_one(optimizer: str, chosen: str) -> None:
    # On a CPU the PyTorch path trains row-wise Adagrad faster than FBGEMM's CPU kernel, and
    # FBGEMM's SGD is the faster SGD (benchmarks/README.md): "auto" takes each, and says why;
    # "fbgemm" still gets FBGEMM.
    batches = zipf_batches(steps=1)
    plan = make_plan(batches, 0.1, 0, "lfu", SUM_TABLES)
    config = RowWiseOptimizerConfig(optimizer)
    auto = HotColdEmbeddingBagCollection.from_ebc(EmbeddingBagCollection(tables=SUM_TABLES), plan, config)
    assert auto.kernel_note.startswith(chosen), auto.kernel_note
    assert chosen == "fbgemm" or "on a CPU" in auto.kernel_note, auto.kernel_note
    named = HotColdEmbeddingBagCollection.from_ebc(EmbeddingBagCollection(tables=SUM_TABLES), plan, config, kernel="fbgemm")
    assert named.kernel_note.startswith("fbgemm")


@pytest.mark.parametrize("kernel", ["fbgemm", "pytorch"])
def test_staging_between_forward_and_backward_is_exact(kernel) -> None:
    # The prefetch thread stages later batches while a step's forward and backward run: the
    # slots it fills must not disturb the step (autograd's saved weights, its locked rows).
    config = RowWiseOptimizerConfig(name="rowwise_adagrad", lr=0.05)
    batches = zipf_batches(seed=7)
    depth = 2
    plan = make_plan(batches, None, depth, "lfu", SUM_TABLES)  # the minimum: every stage evicts
    reference = train_reference(config, batches, UPSTREAM, SUM_TABLES)
    torch.manual_seed(0)
    module = HotColdEmbeddingBagCollection.from_ebc(EmbeddingBagCollection(tables=SUM_TABLES), plan, config, kernel=kernel)
    for batch in batches[:depth]:
        module.prefetch(batch)
    for step, (batch, grad) in enumerate(zip(batches, UPSTREAM)):
        out = module(batch).values()
        if step + depth < len(batches):
            module.prefetch(batches[step + depth])
        out.backward(grad)
    assert module.caches["t_user"].counters.evicted_rows > 0
    assert_same(module, reference)


def _staged_meanwhile(module: HotColdEmbeddingBagCollection, batch: KeyedJaggedTensor | None) -> None:
    """Prefetch ``batch`` on another thread, as the prefetch thread does, and wait for it."""
    if batch is None:
        return
    worker = threading.Thread(target=module.prefetch, args=(batch,), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "staging waited for the step's lookup or row update to finish"


@pytest.mark.parametrize("kernel", ["fbgemm", "pytorch"])
def test_a_prefetch_thread_stages_while_a_step_looks_up_and_updates(kernel, monkeypatch) -> None:
    # The module's lock covers the caches' directories alone: a prefetch thread stages the
    # next batches during a step's lookup and its row update (on the PyTorch path, where the
    # update is ours), and the step still learns what torchrec's does. Were the lock held
    # through them, staging would wait for the step that here waits for it.
    import lightning_hotcache.embedding.update as update

    config = RowWiseOptimizerConfig(name="rowwise_adagrad", lr=0.05)
    batches = zipf_batches(seed=7)
    plan = make_plan(batches, None, 2, "lfu", SUM_TABLES)  # the minimum for 3 batches locked at once: every stage evicts
    reference = train_reference(config, batches, UPSTREAM, SUM_TABLES)
    torch.manual_seed(0)
    module = HotColdEmbeddingBagCollection.from_ebc(EmbeddingBagCollection(tables=SUM_TABLES), plan, config, kernel=kernel)
    ahead = iter(batches[1:])
    lookup = module._lookup

    def lookup_while_staging(staged):
        _staged_meanwhile(module, next(ahead, None))
        return lookup(staged)

    step_read_rows = update.step_read_rows

    def update_while_staging(*args):
        _staged_meanwhile(module, next(ahead, None))
        return step_read_rows(*args)

    module._lookup = lookup_while_staging
    monkeypatch.setattr(update, "step_read_rows", update_while_staging)
    module.prefetch(batches[0])
    for batch, grad in zip(batches, UPSTREAM):
        module(batch).values().backward(grad)
    assert next(ahead, None) is None  # every later batch was staged during a step
    assert module.caches["t_user"].counters.evicted_rows > 0
    assert_same(module, reference)


def test_backward_does_not_wait_for_a_staging_thread_and_its_rows_are_kept() -> None:
    # While a prefetch thread holds the module's lock, backward still steps the batch's rows
    # and returns; marking them changed and unlocking them is left to the lock's next holder,
    # which does it before it could evict or write back anything: nothing is lost.
    config = RowWiseOptimizerConfig(name="rowwise_adagrad", lr=0.05)
    batches = zipf_batches(steps=2, seed=7)
    plan = make_plan(batches, None, 0, "lfu")  # the minimum: the next batch evicts this one's rows
    reference = train_reference(config, batches, UPSTREAM)
    torch.manual_seed(0)
    module = HotColdEmbeddingBagCollection.from_ebc(EmbeddingBagCollection(tables=TABLES), plan, config, kernel="pytorch")
    out = module(batches[0]).values()
    held, backward_done = threading.Event(), threading.Event()

    def stage_meanwhile() -> None:
        with module._staging.lock:
            held.set()
            backward_done.wait(timeout=10)

    holder = threading.Thread(target=stage_meanwhile, daemon=True)
    holder.start()
    held.wait()
    out.backward(UPSTREAM[0])
    assert holder.is_alive(), "backward waited for the lock's holder"
    backward_done.set()
    holder.join()
    assert sum(c.num_locked() for c in module.caches.values()) > 0  # left for the lock's next holder
    module(batches[1]).values().backward(UPSTREAM[1])  # evicts the first batch's rows
    assert sum(c.counters.written_back_rows for c in module.caches.values()) > 0
    assert sum(c.num_locked() for c in module.caches.values()) == 0
    assert_same(module, reference)


def test_fused_backward_unlocks_the_rows_it_updated() -> None:
    # The rows are released by a post-hook on FBGEMM's lookup node, right after its update:
    # if that hook were not found, they would stay locked until the next forward.
    batches = zipf_batches(steps=1)
    plan = make_plan(batches, 0.05, 0, "lfu", SUM_TABLES)
    module = HotColdEmbeddingBagCollection.from_ebc(EmbeddingBagCollection(tables=SUM_TABLES), plan, RowWiseOptimizerConfig("sgd"), kernel="fbgemm")
    assert module.kernel_note.startswith("fbgemm")
    out = module(batches[0]).values()
    assert sum(c.num_locked() for c in module.caches.values()) > 0
    out.backward(UPSTREAM[0])
    assert sum(c.num_locked() for c in module.caches.values()) == 0


# Tables of one width: where the fused kernel runs, their split tables are stacked in one
# cache (lightning_hotcache.cache.group) and the TBE is one table of every cache's slots.
ONE_WIDTH_TABLES = [EmbeddingBagConfig(**{**t.__dict__, "embedding_dim": 8}) for t in SUM_TABLES]
ONE_WIDTH_UPSTREAM = [torch.randn(BATCH, 8 * 4, generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]


@pytest.mark.parametrize(
    ("budget", "policy", "optimizer", "storage", "depth"),
    exactness_matrix(
        ["budget", "policy", "optimizer", "storage", "depth"],
        together={"budget": list(BUDGETS), "policy": POLICIES, "depth": [0, 2]},
        apart={"optimizer": list(FUSED_OPTIMIZERS), "storage": ["memory", "mmap"]},
    ),
)
def test_stacked_split_tables_learn_what_torchrec_learns(budget, policy, optimizer, storage, depth, tmp_path) -> None:
    config = RowWiseOptimizerConfig(name=optimizer, lr=0.05)
    batches = zipf_batches()
    plan = make_plan(batches, BUDGETS[budget], depth, policy, ONE_WIDTH_TABLES)
    reference = train_reference(config, batches, ONE_WIDTH_UPSTREAM, ONE_WIDTH_TABLES)
    module = train_hotcache(config, batches, ONE_WIDTH_UPSTREAM, plan, policy, "memory" if storage == "memory" else tmp_path,
                            depth, ONE_WIDTH_TABLES, kernel="fbgemm")  # fmt: skip
    split = [t.name for t in ONE_WIDTH_TABLES if not plan.table(t.name).on_device]
    assert ("stacked in one cache" in module.kernel_note) == bool(split), module.kernel_note
    assert_same(module, reference)
    # Each table's counters are its own share of the stack's.
    for name in split:
        table = next(t for t in ONE_WIDTH_TABLES if t.name == name)
        read = sum(b[f].values().numel() for b in batches for f in table.feature_names)
        assert module.caches[name].counters.lookups == read
    if split:
        stack = module.caches[split[0]].group
        fields = ("lookups", "hits", "fetched_rows", "evicted_rows", "written_back_rows")
        totals = [sum(getattr(module.caches[n].counters, field) for n in split) for field in fields]
        assert totals == [getattr(stack.counters, field) for field in fields]


def test_stacked_tables_stay_separate_tables_to_fbgemm() -> None:
    # FBGEMM's CPU backward runs its parallel kernel only on tables that one feature reads; a
    # stack read by every feature must still look like one table per model table to it.
    batches = zipf_batches(steps=2)
    plan = make_plan(batches, BUDGETS["10%"], 0, "lfu", ONE_WIDTH_TABLES)
    module = HotColdEmbeddingBagCollection.from_ebc(
        EmbeddingBagCollection(tables=ONE_WIDTH_TABLES), plan, RowWiseOptimizerConfig("sgd"), kernel="fbgemm"
    )
    assert "stacked in one cache" in module.kernel_note
    tbe = module._fused.tbe
    starts = tbe.hash_size_cumsum.tolist()
    rows = tbe.split_embedding_weights()[0].shape[0]
    table_of = {f: t.name for t in ONE_WIDTH_TABLES for f in t.feature_names}
    features = [f for t in ONE_WIDTH_TABLES for f in t.feature_names]
    for k in range(1, len(features)):
        same_table = table_of[features[k]] == table_of[features[k - 1]]
        assert starts[k] - starts[k - 1] == (0 if same_table else rows), (features[k], starts)
    assert starts[-1] - starts[-2] == rows


def test_a_tables_rows_of_a_stacks_host_store_share_its_memory() -> None:
    from lightning_hotcache.cache.host import HostStore

    stack = HostStore("stack", 12, 2, {"momentum": 1})
    table = HostStore.rows_of(stack, "t1", 3, 5)
    assert (table.name, table.num_embeddings) == ("t1", 5)
    table.load("weight", torch.ones(5, 2))
    table.write(torch.tensor([4]), {"weight": torch.full((1, 2), 7.0), "momentum": torch.tensor([[2.0]])})
    assert stack.weight[:, 0].tolist() == [0, 0, 0, 1, 1, 1, 1, 7, 0, 0, 0, 0]
    assert stack.arrays["momentum"][7, 0] == 2.0
    torch.testing.assert_close(table.read(torch.tensor([4]))["weight"], torch.full((1, 2), 7.0))


MEAN_TABLES = [EmbeddingBagConfig(**{**t.__dict__, "pooling": PoolingType.MEAN}) for t in TABLES]


@pytest.mark.parametrize(("weighted", "tables"), [(True, SUM_TABLES), (False, MEAN_TABLES)], ids=["sum-weighted", "mean"])
def test_row_gradients_formed_from_the_output_gradient_are_the_kernels(weighted, tables) -> None:
    # Across ranks the fused kernel's lookup runs without its backward; the rows' gradients
    # are formed by hand (per-sample weights, MEAN's 1/length, a table read by two features,
    # device tables of several widths) and must sum, row by row, to what FBGEMM's own backward
    # applies: with SGD at lr 1 that is the change of every row it read.
    batch = zipf_batches(steps=1, weighted=weighted)[0]
    plan = make_plan([batch], 0.1, 0, "lfu", tables)
    module = HotColdEmbeddingBagCollection.from_ebc(
        EmbeddingBagCollection(tables=tables, is_weighted=weighted), plan, RowWiseOptimizerConfig("sgd", lr=1.0), kernel="fbgemm"
    )
    assert any(not cache.identity for cache in module.caches.values()) and module.layout.shared
    owned = [module._owned_rows(k) for k in range(len(module.layout.device_rows))]
    update = OwnersUpdate(module.layout, owned, module._staging, module.optimizer, RowSharding(), weighted)
    width = sum(t.embedding_dim * len(t.feature_names) for t in tables)
    grad = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(0))
    staged = module._staging.stage(batch)
    summed = [f.summed_gradients(staged.ours, grad, weighted, r.inverse, len(r.rows)) for f, r in zip(update._features, staged.reads)]
    before = [o.storage["weight"].clone() for o in owned]
    (module._lookup(staged) * grad).sum().backward()  # FBGEMM's backward, SGD fused in
    for k, (o, table_sums, reads) in enumerate(zip(owned, summed, staged.reads)):
        expected = torch.zeros_like(before[k]).index_add_(0, reads.rows, table_sums)
        torch.testing.assert_close(before[k] - o.storage["weight"], expected, msg=f"device table {k}")


def test_a_triton_step_keeps_its_tensor_shapes_over_batches_of_other_ids(monkeypatch) -> None:
    # What a CUDA graph's capture needs: with one-hot features and a fixed batch size, every
    # tensor the step's device work (the lookup, and the update in its backward) makes has the
    # same shape from one batch to the next, whatever ids the batch reads (uniform ids against
    # Zipf ones, a cache at 10%). The directory's bookkeeping around it is host work.
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_hotcache.embedding.lookup import EmbeddingBagLookup
    from lightning_hotcache.embedding.update import TritonUpdate

    class Shapes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, tuple]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen.append((str(func), tuple(tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))))
            return out

    tables = [EmbeddingBagConfig(name=f"t_{f}", num_embeddings=n, embedding_dim=8, feature_names=[f]) for f, n in (("a", 900), ("b", 300))]
    rng = np.random.default_rng(0)

    def one_hot(ids_a, ids_b) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.from_numpy(np.concatenate([ids_a, ids_b])), torch.ones(2 * BATCH, dtype=torch.int32))

    zipf = [one_hot(np.minimum(rng.zipf(1.2, BATCH) - 1, 899), np.minimum(rng.zipf(1.2, BATCH) - 1, 299)) for _ in range(3)]
    uniform = [one_hot(rng.integers(0, 900, BATCH), rng.integers(0, 300, BATCH)) for _ in range(3)]
    plan = make_plan(zipf, 0.1, 1, "lfu", tables)
    module = HotColdEmbeddingBagCollection.from_ebc(EmbeddingBagCollection(tables=tables), plan, RowWiseOptimizerConfig("rowwise_adagrad", lr=0.05), kernel="triton")
    assert module.kernel_note.startswith("triton")
    shapes = Shapes()

    def recorded(method):
        def run(*args, **kwargs):
            with shapes:
                return method(*args, **kwargs)

        return run

    monkeypatch.setattr(EmbeddingBagLookup, "pooled", recorded(EmbeddingBagLookup.pooled))
    monkeypatch.setattr(TritonUpdate, "_step", recorded(TritonUpdate._step))
    steps = []
    for batch in [*zipf, *uniform]:
        module.prefetch(batch)
        shapes.seen = []
        module(batch).values().backward(torch.ones(BATCH, 16))
        steps.append(shapes.seen)
    assert steps[0] and any("sort" in op for op, _ in steps[0])  # the update's own ops were seen
    assert sum(c.counters.evicted_rows for c in module.caches.values()) > 0  # the cache turned over
    for k, step in enumerate(steps[1:], 1):
        assert step == steps[0], f"step {k} made tensors of other shapes than step 0"
