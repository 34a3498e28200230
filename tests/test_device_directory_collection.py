"""The collection with its caches' directories in device memory (`DirectoryStaging`) learns what
torchrec's EmbeddingBagCollection learns, and keeps its rows through checkpoints and loads.

On CUDA this is the Triton path's default; here the switch puts it on the CPU, its kernels in
Triton's interpreter (TRITON_INTERPRET=1, set by conftest), host rows in plain CPU tensors.
"""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from conftest import exactness_matrix
from test_embedding import GOOD, two_bags
from test_embedding_exactness import BUDGETS, SUM_TABLES, TABLES, UPSTREAM, assert_same, make_plan, train_hotcache, train_reference, zipf_batches

from lightning_hotcache import RowWiseOptimizerConfig
from lightning_hotcache.cache.host_mapping import HostMappingError, map_for_devices
from lightning_hotcache.embedding import HotColdEmbeddingBagCollection
from lightning_hotcache.embedding.device_staging import DirectoryStaging
from lightning_hotcache.planner.plan import HotColdPlan, TablePlan
from lightning_hotcache._ops.switches import Switch

ON_DEVICE = "cache directory in device memory"


@pytest.fixture(autouse=True)
def device_directory(monkeypatch) -> None:
    monkeypatch.setenv(Switch.DEVICE_DIRECTORY.variable, "1")


def fresh(plan: HotColdPlan, config: RowWiseOptimizerConfig, tables=TABLES, **options) -> HotColdEmbeddingBagCollection:
    """A collection of ``tables`` on the Triton path, its rows torchrec's initial ones (as `train_reference`'s)."""
    torch.manual_seed(0)
    return HotColdEmbeddingBagCollection.from_ebc(EmbeddingBagCollection(tables=tables), plan, config, kernel="triton", **options)


def trained(optimizer: str, budget: str, policy: str, depth: int, steps: int | None = None):
    config = RowWiseOptimizerConfig(name=optimizer, lr=0.05)
    batches = zipf_batches()
    plan = make_plan(batches, BUDGETS[budget], depth, policy)
    module = train_hotcache(config, batches[:steps], UPSTREAM[:steps], plan, policy, "memory", depth, kernel="triton")
    return module, train_reference(config, batches[:steps], UPSTREAM[:steps]), (config, batches, plan)


@pytest.mark.parametrize(
    ("optimizer", "budget", "policy", "depth"),
    exactness_matrix(
        ["optimizer", "budget", "policy", "depth"],
        together={"policy": ["lfu", "lookahead", "lru", "static"]},
        apart={"budget": ["10%", "minimum"], "optimizer": ["sgd", "rowwise_adagrad", "adam"], "depth": [0, 2]},
    ),
)
def test_the_device_directory_learns_what_torchrec_learns(optimizer, budget, policy, depth) -> None:
    module, reference, _ = trained(optimizer, budget, policy, depth)
    assert ON_DEVICE in module.kernel_note and isinstance(module._staging, DirectoryStaging)
    assert_same(module, reference)
    counters = module.caches["t_user"].counters
    assert counters.lookups == 8 * 32  # every value of the table's feature, per table of the stack
    if budget == "minimum":
        assert counters.fetched_rows > 0 and counters.evicted_rows > 0  # the cache really cycled
    assert ("its lookahead window of 3 batches there too" in module.kernel_note) == (policy == "lookahead")
    if policy == "lookahead" and depth:  # batches announced ahead reached the window
        directory = module._caches[next(iter(module.layout.stacks))].on_device
        assert directory.window is not None and directory.announced == len(zipf_batches())


def test_its_counts_are_the_host_directory_s_where_its_one_set_holds_every_row(monkeypatch) -> None:
    # A stack of 30 dynamic slots is one set of 30 ways (fully associative) and holds every row
    # of its tables: each row misses at its first read and hits afterwards, under either directory.
    tables = [
        EmbeddingBagConfig(name="t_a", num_embeddings=20, embedding_dim=4, feature_names=["a"]),
        EmbeddingBagConfig(name="t_b", num_embeddings=10, embedding_dim=4, feature_names=["b"]),
    ]
    generator = torch.Generator().manual_seed(3)
    batches = [
        KeyedJaggedTensor.from_lengths_sync(
            keys=["a", "b"], values=torch.cat([torch.randint(0, 20, (16,), generator=generator), torch.randint(0, 10, (16,), generator=generator)]),
            lengths=torch.ones(32, dtype=torch.int32),
        )
        for _ in range(6)
    ]
    plan = HotColdPlan([TablePlan(t.name, t.num_embeddings, t.embedding_dim, [], t.num_embeddings, 0, 0.0) for t in tables], 1, 0, "lru")
    config = RowWiseOptimizerConfig(name="sgd", lr=0.05)

    def counters() -> list[tuple[int, int, int, int]]:
        module = fresh(plan, config, tables, cache_policy="lru")
        for batch in batches:
            module(batch).values().backward(torch.ones(16, 8))
        return [(c.lookups, c.hits, c.fetched_rows, c.evicted_rows) for c in (module.caches[t.name].counters for t in tables)]

    on_device = counters()
    monkeypatch.setenv(Switch.DEVICE_DIRECTORY.variable, "0")
    assert on_device == counters()
    assert on_device[0][2] > 0 and on_device[0][3] == 0  # rows came in, none left


def test_evaluation_between_training_batches_changes_nothing_and_leaves_its_rows_clean() -> None:
    config = RowWiseOptimizerConfig(name="rowwise_adagrad", lr=0.05)
    batches, evaluated = zipf_batches(), zipf_batches(seed=9)
    plan = make_plan(batches, None, 0, "lru")
    module = fresh(plan, config)
    reference = train_reference(config, batches, UPSTREAM)
    for step, (batch, grad) in enumerate(zip(batches, UPSTREAM)):
        module(batch).values().backward(grad)
        directory = module._caches[next(iter(module.layout.stacks))].on_device
        before = directory.ids.clone()
        with torch.no_grad():
            module(evaluated[step])
        came_in = (directory.ids != before) & (directory.ids >= 0)
        assert bool(came_in.any()) and not bool(directory.dirty[came_in].any())  # rows read only to evaluate stay clean
        assert directory.num_held() == 0  # the evaluation batch held its cells for its lookup alone
    assert_same(module, reference)


def test_a_checkpoint_with_changed_rows_still_cached_and_its_resume_learn_what_torchrec_learns() -> None:
    # Four steps, a checkpoint read while the cache holds rows changed since they came in, four
    # more steps; and a new module resumed from that checkpoint for the last four: all equal
    # to torchrec's eight steps.
    config = RowWiseOptimizerConfig(name="rowwise_adagrad", lr=0.05)
    batches = zipf_batches()
    plan = make_plan(batches, None, 0, "lfu")
    module = fresh(plan, config)
    for batch, grad in zip(batches[:4], UPSTREAM[:4]):
        module(batch).values().backward(grad)
    stack = module._caches[next(iter(module.layout.stacks))]
    assert bool((stack.on_device.dirty & (stack.on_device.ids >= 0)).any())  # changed rows are cached
    # Copies: a state_dict's tensors are the live rows, as torch's modules' are.
    tables = {key: value.clone() for key, value in module.state_dict().items()}
    state = {name: {key: value.clone() for key, value in arrays.items()} for name, arrays in module.optimizer_state().items()}
    assert_same(module, train_reference(config, batches[:4], UPSTREAM[:4]))
    for batch, grad in zip(batches[4:], UPSTREAM[4:]):
        module(batch).values().backward(grad)
    reference = train_reference(config, batches, UPSTREAM)
    assert_same(module, reference)

    resumed = fresh(plan, config)
    for batch, grad in zip(batches[:2], UPSTREAM[:2]):  # rows cached and changed before the load
        resumed(batch).values().backward(grad)
    resumed.load_state_dict(tables)
    resumed.load_optimizer_state(state)
    for batch, grad in zip(batches[4:], UPSTREAM[4:]):
        resumed(batch).values().backward(grad)
    assert_same(resumed, reference)


def test_loading_one_table_keeps_the_changed_rows_of_the_tables_stacked_with_it() -> None:
    # t_tag and t_user share a stack (of width 8) and its directory: a load of t_tag's rows must
    # not lose t_user's rows changed while cached.
    config = RowWiseOptimizerConfig(name="rowwise_adagrad", lr=0.05)
    batches = zipf_batches()
    module = fresh(make_plan(batches, None, 0, "lru"), config)
    for batch, grad in zip(batches[:4], UPSTREAM[:4]):
        module(batch).values().backward(grad)
    reference = train_reference(config, batches[:4], UPSTREAM[:4])
    directory = module._caches[next(iter(module.layout.stacks))].on_device
    assert bool(directory.dirty.any())
    tag = "embedding_bags.t_tag.weight"  # its current rows, read from the reference: reading the module's would write back
    module.load_state_dict({tag: reference.state_dict()[tag]}, strict=False)
    assert_same(module, reference)


def test_initialized_rows_are_those_of_the_host_directory(monkeypatch) -> None:
    # Rows made in place in the host store (a deferred collection's initialization) after a
    # few steps: no cached row may be written back over them.
    config = RowWiseOptimizerConfig(name="sgd", lr=0.05)
    batches = zipf_batches()
    plan = make_plan(batches, 0.1, 0, "lru")

    def initialized() -> dict[str, torch.Tensor]:
        module = fresh(plan, config)
        for batch, grad in zip(batches[:3], UPSTREAM[:3]):
            module(batch).values().backward(grad)
        module.reset_parameters(seed=7)
        return module.state_dict()

    on_device = initialized()
    monkeypatch.setenv(Switch.DEVICE_DIRECTORY.variable, "0")
    torch.testing.assert_close(on_device, initialized(), rtol=0, atol=0)


@pytest.mark.parametrize(("feature", "bad", "table"), [("user", 1500, "t_user"), ("item_hist", -1, "t_item")])
def test_out_of_range_ids_are_refused_before_any_row_or_cell_is_touched(feature, bad, table) -> None:
    config = RowWiseOptimizerConfig(name="sgd", lr=0.05)
    module = fresh(make_plan(zipf_batches(), None, 0, "lru"), config)
    module(zipf_batches(1)[0]).values().sum().backward()
    directory = module._caches[next(iter(module.layout.stacks))].on_device
    before, cells = module.state_dict(), directory.ids.clone()
    lookups = {n: c.counters.lookups for n, c in module.caches.items()}
    batch = two_bags(**{**GOOD, feature: [0, bad]})
    with pytest.raises(ValueError, match=rf"Feature '{feature}' of table '{table}' has id {bad}"):
        module.prefetch(batch)
    with pytest.raises(ValueError, match=rf"Feature '{feature}' of table '{table}' has id {bad}"):
        module(batch)  # not checked ahead: checked at its forward
    assert torch.equal(directory.ids, cells) and {n: c.counters.lookups for n, c in module.caches.items()} == lookups
    torch.testing.assert_close(module.state_dict(), before, rtol=0, atol=0)


def test_a_recording_refused_after_its_batch_was_admitted_leaves_no_cell_held() -> None:
    # A step recorded for a CUDA graph admits its batch's rows, then reads the host and is refused.
    # The admission never ran (on CUDA; the stand-in puts back what it wrote), so when the next
    # forward finds the batch abandoned it must not release cells for it: that would take the
    # holds of other batches away, and a row in flight could be evicted under them.
    from torchrec.datasets.utils import Batch

    from lightning_hotcache._ops.graph_batches import TorchRecBatches
    from lightning_hotcache._ops.step_graph import StandInGraphs, StepGraph

    config = RowWiseOptimizerConfig(name="rowwise_adagrad", lr=0.05)
    batches = zipf_batches()
    module = fresh(make_plan(batches, None, 0, "lfu"), config)

    def reads_the_host(b: Batch) -> torch.Tensor:
        out = module(b.sparse_features).values()
        float(out.sum())  # refused by a capture, after the admission
        out.backward(b.dense_features)
        return out

    graph = StepGraph(reads_the_host, TorchRecBatches(), StandInGraphs(), touched=module.step_tensors, warmup=1)
    first = Batch(dense_features=UPSTREAM[0], sparse_features=batches[0], labels=torch.zeros(len(UPSTREAM[0])))
    assert graph.run(first) is None and "HostReadInGraph" in graph.eager_reason
    for batch, grad in zip(batches, UPSTREAM):  # the refused batch again, eagerly, and the rest
        module(batch).values().backward(grad)
    directory = module._caches[next(iter(module.layout.stacks))].on_device
    assert int(directory.holders.min()) == 0 and directory.num_held() == 0
    assert_same(module, train_reference(config, batches, UPSTREAM))


def test_per_sample_weights_learn_what_torchrec_learns() -> None:
    config = RowWiseOptimizerConfig(name="rowwise_adagrad", lr=0.05)
    batches = zipf_batches(weighted=True, seed=3)
    plan = make_plan(batches, None, 2, "lfu", tables=SUM_TABLES)
    module = train_hotcache(config, batches, UPSTREAM, plan, "lfu", "memory", 2, tables=SUM_TABLES, weighted=True, kernel="triton")
    assert ON_DEVICE in module.kernel_note
    assert_same(module, train_reference(config, batches, UPSTREAM, tables=SUM_TABLES, weighted=True))


@pytest.mark.parametrize(
    ("options", "why"),
    [({"kernel": "pytorch"}, "it needs the Triton kernels"),
     ({"host_storage": "a directory"}, "host_storage is a directory of memory-mapped files")],
)  # fmt: skip
def test_configurations_the_device_directory_does_not_serve_keep_the_host_directory(options, why, tmp_path) -> None:
    batches = zipf_batches()
    plan = make_plan(batches, None, 0, options.get("cache_policy", "lru"))
    options = {"optimizer": RowWiseOptimizerConfig(name="sgd", lr=0.05), "kernel": "triton", **options}
    optimizer = options.pop("optimizer")
    if "host_storage" in options:
        options["host_storage"] = str(tmp_path)
    module = HotColdEmbeddingBagCollection.from_ebc(EmbeddingBagCollection(tables=TABLES), plan, optimizer, **options)
    assert ON_DEVICE not in module.kernel_note
    assert f"cache directory on the host ({why})" in module.kernel_note  # the log line says what keeps it there
    assert not isinstance(module._staging, DirectoryStaging)


def test_host_rows_cannot_be_mapped_without_a_cuda_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device maps host rows (tests/test_cuda.py)")
    with pytest.raises(HostMappingError, match="cannot map a host array for the CUDA kernels: no CUDA device"):
        map_for_devices(torch.zeros(4, 4))


def test_host_rows_the_driver_refuses_to_lock_are_refused_with_the_fix(monkeypatch) -> None:
    class Refusing:  # cudaHostRegister answering cudaErrorMemoryAllocation
        def cudaHostRegister(self, pointer: int, size: int, flags: int) -> int:
            return 2

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", Refusing)
    with pytest.raises(HostMappingError, match=r"refused to page-lock 4096 bytes of host memory \(2\).*host_storage=<directory>"):
        map_for_devices(torch.zeros(32, 32))


@pytest.mark.parametrize("fault", ["second-array-refused", "kernels-cannot-read"])
def test_arrays_mapped_before_a_refusal_are_unmapped(fault, monkeypatch) -> None:
    from lightning_hotcache.cache import host_mapping

    class Driver:  # registers what it is asked to, except a second array where the fault says so
        def __init__(self) -> None:
            self.registered: set[int] = set()

        def cudaHostRegister(self, pointer: int, size: int, flags: int) -> int:
            if fault == "second-array-refused" and self.registered:
                return 2
            self.registered.add(pointer)
            return 0

        def cudaHostUnregister(self, pointer: int) -> int:
            self.registered.remove(pointer)
            return 0

    def unreadable(array, device):
        raise host_mapping.HostMappingError("the Triton kernels could not read the mapped host rows (a test)")

    driver = Driver()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: driver)
    monkeypatch.setattr(host_mapping, "check_the_kernels_read", unreadable if fault == "kernels-cannot-read" else lambda a, d: None)
    arrays = [torch.zeros(8, 4), torch.zeros(8, 1)]
    with pytest.raises(HostMappingError):
        host_mapping.map_all_for_devices(arrays, torch.device("cpu"))
    assert driver.registered == set()  # the host directory keeps these arrays: none stays page-locked
    monkeypatch.setattr(host_mapping, "check_the_kernels_read", lambda a, d: None)
    driver = Driver()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: driver)
    if fault == "kernels-cannot-read":
        host_mapping.map_all_for_devices(arrays, torch.device("cpu"))
        assert driver.registered == {a.data_ptr() for a in arrays}  # without a fault every array stays mapped


def test_the_kernels_reading_mapped_host_rows_is_checked_before_a_step() -> None:
    from lightning_hotcache.cache.host_mapping import check_the_kernels_read

    for rows in (torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.zeros(3, 4)):  # drawn, and not yet
        before = rows.clone()
        check_the_kernels_read(rows, torch.device("cpu"))  # the interpreter reads host rows as they are
        assert torch.equal(rows, before)  # the values it read put back


@pytest.mark.parametrize("fault", ["refused", "wrong"])
def test_kernels_that_cannot_read_mapped_host_rows_are_a_clear_error(fault, monkeypatch) -> None:
    from lightning_hotcache.cache import host_mapping

    def pooled(*args, **kwargs):
        if fault == "refused":  # as Triton's launcher says of a pointer it cannot resolve
            raise ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")
        return torch.zeros(1, 4)

    monkeypatch.setattr(host_mapping.triton_tbe, "pooled", pooled)
    why = r"could not read the mapped host rows \(Pointer argument" if fault == "refused" else "read other values"
    rows = torch.zeros(3, 4)  # rows not yet drawn: a read that returns zeros is still caught
    with pytest.raises(HostMappingError, match=why):
        host_mapping.check_the_kernels_read(rows, torch.device("cpu"))
    assert torch.equal(rows, torch.zeros(3, 4))
