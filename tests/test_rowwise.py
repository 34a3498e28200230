"""The row-wise embedding rule: FBGEMM's math where FBGEMM has a CPU kernel, a reference elsewhere."""

import copy
import itertools
from collections import Counter

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from lightning_hotcache import RowWiseOptimizer, RowWiseOptimizerConfig, use_sparse_gradients
from lightning_hotcache.embedding.batch import sorted_reads
from lightning_hotcache.optim.rowwise import step_read_rows
from lightning_hotcache._ops.sorting import sum_bag_rows

ROWS, DIM = 20, 8


def _bags_with_duplicates(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, ROWS // 2, (12,), generator=g)  # rows >= ROWS//2 are never read
        offsets = torch.arange(0, 12, 3)
        out.append((ids, offsets, torch.randn(4, DIM, generator=g)))
    return out


@pytest.mark.parametrize(
    ("name", "fbgemm_type"), [("sgd", EmbOptimType.EXACT_SGD), ("rowwise_adagrad", EmbOptimType.EXACT_ROWWISE_ADAGRAD)]
)
def test_matches_fbgemm_cpu_kernel(name: str, fbgemm_type: EmbOptimType) -> None:
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(ROWS, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=fbgemm_type,
        learning_rate=0.1,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
    )
    bag = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
    bag.weight.data.copy_(tbe.split_embedding_weights()[0])
    optimizer = RowWiseOptimizer([bag.weight], RowWiseOptimizerConfig(name=name, lr=0.1, eps=1e-8))
    for ids, offsets, upstream in _bags_with_duplicates(4):
        tbe(ids, torch.cat([offsets, torch.tensor([12])])).backward(upstream)
        bag(ids, offsets).backward(upstream)
        optimizer.step()
    torch.testing.assert_close(bag.weight.detach(), tbe.split_embedding_weights()[0], rtol=1e-5, atol=1e-6)


def test_adam_matches_reference_and_leaves_unread_rows_alone() -> None:
    config = RowWiseOptimizerConfig(name="adam", lr=0.01, beta1=0.9, beta2=0.99, eps=1e-6)
    bag = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
    reference = bag.weight.detach().clone()
    m, v, steps = torch.zeros(ROWS, DIM), torch.zeros(ROWS, DIM), torch.zeros(ROWS)
    optimizer = RowWiseOptimizer([bag.weight], config)
    for ids, offsets, upstream in _bags_with_duplicates(5):
        bag(ids, offsets).backward(upstream)
        optimizer.step()
        # Reference: per-sample gradient scattered, duplicates summed, lazy Adam per row.
        grad = torch.zeros(ROWS, DIM)
        sample_of = torch.repeat_interleave(torch.arange(4), 3)
        grad.index_add_(0, ids, upstream[sample_of])
        for row in ids.unique().tolist():
            steps[row] += 1
            m[row] = 0.9 * m[row] + 0.1 * grad[row]
            v[row] = 0.99 * v[row] + 0.01 * grad[row] ** 2
            m_hat, v_hat = m[row] / (1 - 0.9 ** steps[row]), v[row] / (1 - 0.99 ** steps[row])
            reference[row] -= 0.01 * m_hat / (v_hat.sqrt() + 1e-6)
    torch.testing.assert_close(bag.weight.detach(), reference, rtol=1e-5, atol=1e-6)
    state = optimizer.state[bag.weight]
    assert torch.equal(state["step"][ROWS // 2 :], torch.zeros(ROWS - ROWS // 2, 1))
    assert torch.equal(state["step"][:, 0], steps)


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "adam"])
def test_same_result_as_torchrec_in_backward_optimizer(name: str) -> None:
    """Stepping after backward (our plain path) == TorchRec's apply_optimizer_in_backward."""
    config = RowWiseOptimizerConfig(name=name, lr=0.05)
    tables = [EmbeddingBagConfig(name="t", num_embeddings=ROWS, embedding_dim=DIM, feature_names=["f"])]
    torch.manual_seed(0)
    in_backward = EmbeddingBagCollection(tables=tables)
    after_backward = EmbeddingBagCollection(tables=tables)
    after_backward.load_state_dict(in_backward.state_dict())
    apply_optimizer_in_backward(RowWiseOptimizer, use_sparse_gradients(in_backward), {"config": config})
    optimizer = RowWiseOptimizer(use_sparse_gradients(after_backward), config)
    for ids, offsets, upstream in _bags_with_duplicates(4, seed=1):
        kjt = KeyedJaggedTensor.from_offsets_sync(keys=["f"], values=ids, offsets=torch.cat([offsets, torch.tensor([12])]))
        in_backward(kjt).values().backward(upstream)
        after_backward(kjt).values().backward(upstream)
        optimizer.step()
    torch.testing.assert_close(in_backward.state_dict(), after_backward.state_dict())


@pytest.mark.parametrize(("name", "reference"), [("rowwise_adagrad", RowWiseAdagrad), ("adam", torch.optim.Adam)])
def test_default_eps_is_the_reference_optimizers(name: str, reference: type[torch.optim.Optimizer]) -> None:
    """Issue 23 item 5: without eps set, our rule steps as TorchRec's RowWiseAdagrad (eps 1e-10)
    and torch's Adam (1e-8) do with theirs unset. Gradients of 1e-9 make eps count: with
    1e-8 for Adagrad the step came out 10x too small."""
    config = RowWiseOptimizerConfig(name=name, lr=0.05)
    ours = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
    theirs = torch.nn.Parameter(ours.weight.detach().clone())
    optimizer, reference_optimizer = RowWiseOptimizer([ours.weight], config), reference([theirs], lr=0.05)
    ids, offsets = torch.tensor([3]), torch.tensor([0])
    upstream = torch.full((1, DIM), 1e-9)
    for _ in range(2):
        ours(ids, offsets).backward(upstream)
        optimizer.step()
        theirs.grad = torch.zeros(ROWS, DIM).index_copy_(0, ids, upstream)
        reference_optimizer.step()
    torch.testing.assert_close(ours.weight.detach()[3], theirs.detach()[3], rtol=1e-6, atol=0.0)


def test_state_round_trips_through_state_dict() -> None:
    config = RowWiseOptimizerConfig(name="rowwise_adagrad")
    bag = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
    optimizer = RowWiseOptimizer([bag.weight], config)
    (ids, offsets, upstream), *_ = _bags_with_duplicates(1)
    bag(ids, offsets).backward(upstream)
    optimizer.step()
    restored = RowWiseOptimizer([bag.weight], config)
    restored.load_state_dict(optimizer.state_dict())
    torch.testing.assert_close(restored.state[bag.weight]["momentum"], optimizer.state[bag.weight]["momentum"])


def test_state_loaded_into_a_stepping_optimizer_is_the_state_it_steps_from() -> None:
    # The tables' row state lives in one array per width, their entries in `state` being views
    # of it: state put there from outside (a checkpoint, load_state_dict) must be taken in, not
    # left beside the arrays the steps read.
    config = RowWiseOptimizerConfig(name="adam")
    batches = _bags_with_duplicates(4, seed=1)

    def tables() -> list[torch.nn.EmbeddingBag]:
        torch.manual_seed(0)
        return [torch.nn.EmbeddingBag(ROWS, dim, mode="sum", sparse=True) for dim in (DIM, 4, DIM)]

    def step(bags: list[torch.nn.EmbeddingBag], optimizer: RowWiseOptimizer, batch: tuple) -> None:
        ids, offsets, _ = batch
        for bag in bags:
            bag(ids, offsets).pow(2).sum().backward()
        optimizer.step()

    ours, theirs = tables(), tables()
    our_optimizer = RowWiseOptimizer([bag.weight for bag in ours], config)
    their_optimizer = RowWiseOptimizer([bag.weight for bag in theirs], config)
    step(ours, our_optimizer, batches[0])
    step(theirs, their_optimizer, batches[3])  # a state of their own, in their arrays
    their_optimizer.load_state_dict(copy.deepcopy(our_optimizer.state_dict()))  # as from a checkpoint file
    with torch.no_grad():
        for their, our in zip(theirs, ours):
            their.weight.copy_(our.weight)
    for batch in batches[1:3]:
        step(ours, our_optimizer, batch)
        step(theirs, their_optimizer, batch)
    for their, our in zip(theirs, ours):
        assert torch.equal(their.weight, our.weight)
        for key, value in our_optimizer.state[our.weight].items():
            assert torch.equal(their_optimizer.state[their.weight][key], value), key


def test_restored_state_of_another_shape_is_a_clear_error() -> None:
    bag = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
    optimizer = RowWiseOptimizer([bag.weight], RowWiseOptimizerConfig(name="rowwise_adagrad"))
    optimizer.state[bag.weight] = {"momentum": torch.zeros(ROWS + 1, 1)}  # another table's
    bag(torch.tensor([1, 2]), torch.tensor([0])).sum().backward()
    with pytest.raises(ValueError, match=r"Row state 'momentum' of an embedding table of shape \(20, 8\) has shape \(21, 1\)"):
        optimizer.step()


def test_dense_gradients_are_refused() -> None:
    bag = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum")
    bag(torch.tensor([1, 2]), torch.tensor([0])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        RowWiseOptimizer([bag.weight]).step()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"name": "adagrad"}, "Unknown row-wise optimizer"), ({"lr": 0.0}, "lr"), ({"beta2": 1.0}, "beta2")],
)
def test_bad_config_is_a_clear_error(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RowWiseOptimizerConfig(**kwargs)


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: Counter[str] = Counter()
        self.computed: Counter[str] = Counter()  # views (a slice, a sparse tensor's values) left out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names[func.__name__] += 1
        self.computed[func.__name__] += not func.is_view
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["rowwise_adagrad", "adam"])
def test_tables_of_several_widths_step_together_without_coalescing_sparse_gradients(name: str) -> None:
    # Coalescing COO gradients was 19 of a 32 ms step of `auto` on an H200 (one values kernel
    # summing a hot row's duplicates serially, table by table): one sort per width instead.
    from lightning_hotcache.optim.rowwise import step_rows

    config = RowWiseOptimizerConfig(name=name, lr=0.1)
    torch.manual_seed(0)
    bags = [torch.nn.EmbeddingBag(ROWS, dim, mode="sum", sparse=True) for dim in (DIM, 4, DIM, DIM)]
    expected = [bag.weight.detach().clone() for bag in bags]
    expected_state = [{k: torch.zeros(ROWS, w) for k, w in config.state_widths(bag.weight.shape[1]).items()} for bag in bags]
    optimizer = RowWiseOptimizer([bag.weight for bag in bags], config)
    for step, (ids, offsets, _) in enumerate(_bags_with_duplicates(3)):
        for bag in bags[: 3 if step == 1 else 4]:  # a table some steps do not read
            bag(ids, offsets).pow(2).sum().backward()
        for bag, weight, state in zip(bags, expected, expected_state):  # the reference: coalesced, one table at a time
            if bag.weight.grad is not None:
                grad = bag.weight.grad.coalesce()
                step_rows(config, weight, state, grad.indices()[0], grad.values())
        with _RecordOps() as ops:
            optimizer.step()
        assert "_coalesce" not in ops.names and "coalesce" not in ops.names
        # The rule's kernels once per width (two here), not once per table (three or four).
        assert ops.names["addcdiv_.default"] == 2
        for bag, weight in zip(bags, expected):
            torch.testing.assert_close(bag.weight.detach(), weight, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["rowwise_adagrad", "adam"])
def test_a_step_grows_with_the_tables_only_by_their_weights_gathers(name: str) -> None:
    # Under `auto` every table is a parameter of its own, so its weight rows are gathered and
    # written apart (written by a compiled copy on CPU: no op); its row state is a view of one
    # array per width, and nothing else a step runs may grow with the tables either: on CUDA
    # each op is a kernel launched from Python, and `auto`'s step was bound by its Python on the H200.
    def ops_of_a_step(num_tables: int) -> Counter[str]:
        bags = [torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True) for _ in range(num_tables)]
        optimizer = RowWiseOptimizer([bag.weight for bag in bags], RowWiseOptimizerConfig(name=name))
        for ids, offsets, _ in _bags_with_duplicates(2):  # the first step makes the state, the second counts
            for bag in bags:
                bag(ids, offsets).sum().backward()
            with _RecordOps() as ops:
                optimizer.step()
        return ops.computed

    few, many = ops_of_a_step(8), ops_of_a_step(26)
    grown = {op: many[op] - few[op] for op in many.keys() | few.keys() if many[op] != few[op]}
    assert grown == {"index_select.default": 18, "is_coalesced.default": 18}


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "adam"])
def test_state_is_brought_up_to_date_once_a_step_per_width(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Bringing a stack up to date looks at every table of it: once per table (SGD's and
    # sparse_ddp's coalesced gradients step table by table) would grow with the tables squared.
    from lightning_hotcache.optim import rowwise

    adopted = Counter()
    adopt = rowwise._StateStack.adopt

    def counted(stack: rowwise._StateStack, state: dict) -> None:
        adopted[id(stack)] += 1
        adopt(stack, state)

    monkeypatch.setattr(rowwise._StateStack, "adopt", counted)
    bags = [torch.nn.EmbeddingBag(ROWS, dim, mode="sum", sparse=True) for dim in (DIM, DIM, 4, DIM, 4)]
    optimizer = RowWiseOptimizer([bag.weight for bag in bags], RowWiseOptimizerConfig(name=name))
    for ids, offsets, _ in _bags_with_duplicates(3):
        for bag in bags:
            bag(ids, offsets).sum().backward()
        if name == "sgd":  # coalesced gradients, as sparse_ddp's come
            for bag in bags:
                bag.weight.grad = bag.weight.grad.coalesce()
        adopted.clear()
        optimizer.step()
    assert sorted(adopted.values()) == [1, 1]


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "adam"])
def test_a_step_from_sorted_reads_with_repeats_equals_one_from_distinct_rows(name: str) -> None:
    # `sorted_reads` (the PyTorch path's reads on CUDA) keeps every value's row, repeats
    # included; each repeat is stepped from its row's summed gradient and writes the same values.
    config = RowWiseOptimizerConfig(name=name, lr=0.1)
    generator = torch.Generator().manual_seed(0)
    rows = torch.tensor([7, 2, 7, 7, 0, 2, 9])
    value_grads = torch.randn(len(rows), 4, generator=generator)
    table = torch.randn(10, 4, generator=generator)
    state = {key: torch.rand(10, width, generator=generator) for key, width in config.state_widths(4).items()}
    distinct, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    expected_table, expected_state = table.clone(), {key: value.clone() for key, value in state.items()}
    summed = sum_bag_rows(value_grads, torch.ones(len(rows), dtype=torch.int64), inverse, len(distinct))
    step_read_rows(config, expected_table, expected_state, distinct, summed)

    reads = sorted_reads(rows)
    assert reads.rows.tolist() == sorted(rows.tolist())
    assert torch.equal(reads.inverse, inverse) and reads.segment.tolist() == [0, 1, 1, 2, 2, 2, 3]
    summed = sum_bag_rows(value_grads, torch.ones(len(rows), dtype=torch.int64), reads.inverse, len(reads.rows))
    step_read_rows(config, table, state, reads.rows, summed, reads.segment)
    torch.testing.assert_close(table, expected_table)
    for key in state:
        torch.testing.assert_close(state[key], expected_state[key], msg=key)


def test_sorted_reads_of_no_rows() -> None:
    reads = sorted_reads(torch.empty(0, dtype=torch.int64))
    assert reads.rows.numel() == reads.inverse.numel() == reads.segment.numel() == 0


def _gradients_of(bags: list[torch.nn.EmbeddingBag], step: int) -> None:
    ids, offsets, weights = _bags_with_duplicates(1, seed=step)[0]
    for bag in bags:
        (bag(ids, offsets) * weights[:, : bag.embedding_dim]).sum().backward()


@pytest.mark.parametrize("order", ["the optimizer's", "another"])
@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "adam"])
def test_gradient_rows_handed_over_step_as_the_tables_sparse_gradients(name: str, order: str) -> None:
    # A lookup may hand several tables' gradient rows over as one piece (numbered as the tables
    # laid end to end, in the order it names them) instead of each table's .grad: the same
    # step, here beside a table of another width and one of the same width left to .grad.
    config = RowWiseOptimizerConfig(name=name, lr=0.1)
    torch.manual_seed(0)
    bags = [torch.nn.EmbeddingBag(ROWS + k, dim, mode="sum", sparse=True) for k, dim in enumerate((DIM, DIM, 4, DIM))]
    handed = copy.deepcopy(bags)
    reference, optimizer = (RowWiseOptimizer([bag.weight for bag in b], config) for b in (bags, handed))
    together = [handed[3], handed[0]] if order == "another" else [handed[0], handed[1]]
    for step in range(3):
        _gradients_of(bags, step)
        reference.step()
        _gradients_of(handed, step)
        for piece in range(2):  # as two backwards would hand them over
            firsts = itertools.accumulate((len(bag.weight) for bag in together), initial=0)
            rows, grads = [], []
            for bag, first in zip(together, firsts):
                grad = bag.weight.grad
                half = len(grad._indices()[0]) // 2
                span = slice(0, half) if piece == 0 else slice(half, None)
                rows.append(grad._indices()[0][span] + first)
                grads.append(grad._values()[span])
            optimizer.add_row_gradients([bag.weight for bag in together], torch.cat(rows), torch.cat(grads))
        for bag in together:
            bag.weight.grad = None
        optimizer.step()
        for want, got in zip(bags, handed):
            assert torch.equal(got.weight, want.weight)
    wanted, got = reference.state_dict()["state"], optimizer.state_dict()["state"]
    assert wanted.keys() == got.keys()
    for table in wanted:
        for key in wanted[table]:
            assert torch.equal(got[table][key], wanted[table][key]), (table, key)


def test_handed_over_gradients_are_dropped_by_zero_grad() -> None:
    bag = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
    before = bag.weight.detach().clone()
    optimizer = RowWiseOptimizer([bag.weight], RowWiseOptimizerConfig("sgd"))
    optimizer.add_row_gradients([bag.weight], torch.tensor([1, 1, 3]), torch.ones(3, DIM))
    optimizer.zero_grad()
    optimizer.step()
    assert torch.equal(bag.weight, before)


def test_a_gradient_handed_over_for_another_table_is_a_clear_error() -> None:
    bags = [torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True) for _ in range(2)]
    optimizer = RowWiseOptimizer([bags[0].weight], RowWiseOptimizerConfig("sgd"))
    optimizer.add_row_gradients([bags[1].weight], torch.tensor([1]), torch.ones(1, DIM))
    with pytest.raises(ValueError, match=r"not one of its parameters"):
        optimizer.step()
