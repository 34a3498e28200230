"""A plain collection's tables as one stack of rows (`lightning_hotcache.optim.stacked_tables`): the
zoo's models make them so, eager or deferred, keep them so through casts and moves, change no
value, name or parameter by it, and `auto`'s step then costs the same ops for 8 tables as for 26;
a table taken out of the stack is looked up and stepped where it is.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from conftest import tiny_synthetic
from test_step_ops import _CountOps
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from lightning_hotcache._ops import sorting
from lightning_hotcache.optim import rowwise
from lightning_hotcache.embedding.torchrec_lookup import pooled_in_one_node
from lightning_hotcache.optim.rowwise import RowWiseOptimizer, RowWiseOptimizerConfig, use_sparse_gradients
from lightning_hotcache.optim.stacked_tables import stack_tables, stacked_rows
from lightning_hotcache.embedding.table_init import materialize_tables
from models import DeepFM

ROWS, DIM, BATCH = 300, 8, 32


def _collection(num_tables: int, stacked: bool = True) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{k}", num_embeddings=ROWS + k, embedding_dim=DIM, feature_names=[f"f{k}"]) for k in range(num_tables)]
    )
    use_sparse_gradients(ebc)
    if stacked:
        stack_tables(ebc)
    return ebc


def _batch(num_tables: int, seed: int = 0) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (num_tables * BATCH,), generator=g)
    return KeyedJaggedTensor(
        keys=[f"f{k}" for k in range(num_tables)], values=torch.randint(0, ROWS, (int(lengths.sum()),), generator=g), lengths=lengths
    ).sync()


def _weights(module: torch.nn.Module) -> list[torch.Tensor]:
    return [bag.weight for bag in module.modules() if isinstance(bag, torch.nn.EmbeddingBag)]


def test_stacking_changes_no_value_name_or_parameter() -> None:
    apart = _collection(3, stacked=False)
    before = {name: value.clone() for name, value in apart.state_dict().items()}
    parameters = list(apart.parameters())
    assert stacked_rows(parameters) is None
    stack_tables(apart)
    stack = stacked_rows(parameters)
    assert stack is not None and stack.shape == (3 * ROWS + 3, DIM)
    assert list(apart.parameters()) == parameters  # the same objects: optimizers keep them
    assert apart.state_dict().keys() == before.keys()
    for name, value in apart.state_dict().items():
        assert torch.equal(value, before[name]), name
    # A state dict loaded in is copied into the stack, which stays.
    apart.load_state_dict({name: torch.zeros_like(value) for name, value in before.items()})
    loaded = stacked_rows(parameters)
    assert loaded is not None and torch.equal(loaded, torch.zeros_like(stack))


def test_the_zoos_tables_are_stacked_eager_and_deferred() -> None:
    dm = tiny_synthetic()
    torch.manual_seed(0)
    eager = DeepFM(tables=dm.tables, num_dense_features=dm.num_dense_features)
    # The embedding tower's tables and the first-order weights: a stack each.
    assert stacked_rows(_weights(eager.sparse_arch)) is not None
    assert stacked_rows(_weights(eager.first_order_arch)) is not None
    deferred = DeepFM(tables=dm.tables, num_dense_features=dm.num_dense_features, defer_table_init=True)
    twin = copy.deepcopy(deferred)
    materialize_tables(deferred, seed=5)
    assert stacked_rows(_weights(deferred.sparse_arch)) is not None
    # Rows as a collection of tables apart gets them (one that cannot share a stack: a buffer left declared).
    for collection in twin.modules():
        if isinstance(collection, EmbeddingBagCollection):
            collection.register_buffer("declared", torch.empty(1, device="meta"))
    materialize_tables(twin, seed=5)
    assert stacked_rows(_weights(twin.sparse_arch)) is None
    for weight, expected in zip(_weights(deferred), _weights(twin)):
        assert torch.equal(weight, expected)


def test_casts_and_moves_take_the_stack_whole() -> None:
    dm = tiny_synthetic()
    model = DeepFM(tables=dm.tables, num_dense_features=dm.num_dense_features)
    weights = _weights(model.sparse_arch)
    values = [w.detach().clone() for w in weights]
    model.double()
    stack = stacked_rows(weights)
    assert stack is not None and stack.dtype == torch.float64
    model.float()
    assert stacked_rows(weights) is not None
    for weight, value in zip(weights, values):
        assert torch.equal(weight, value)
    model.to("meta")  # TorchRec's way to declare; nothing to keep there, and no error
    assert all(w.is_meta for w in _weights(model))


def test_a_table_taken_out_of_the_stack_is_looked_up_and_stepped_where_it_is() -> None:
    stacked, apart = _collection(3), _collection(3, stacked=False)
    stack = stacked_rows(list(stacked.parameters()))
    own = stacked.embedding_bags["t1"].weight
    own.data = own.data.clone()  # a user's swap: the stack's rows of t1 are no table's now
    left_behind = stack[ROWS : 2 * ROWS + 1].clone()
    assert stacked_rows(list(stacked.parameters())) is None
    features = _batch(3)
    for ebc in (stacked, apart):
        optimizer = RowWiseOptimizer(ebc.parameters(), RowWiseOptimizerConfig("adam", lr=0.1))
        pooled_in_one_node(ebc, features).square().sum().backward()
        optimizer.step()
    for name in ("t0", "t1", "t2"):
        assert torch.equal(stacked.embedding_bags[name].weight, apart.embedding_bags[name].weight), name
    assert not torch.equal(own, left_behind) and torch.equal(stack[ROWS : 2 * ROWS + 1], left_behind)


@pytest.mark.parametrize("sort", ["distinct", "with-repeats"])
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_auto_steps_on_the_stack_as_on_tables_apart(optimizer: str, sort: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # "with-repeats": the stack's rows sorted as on CUDA (`SORTS_WITH_REPEATS_ON`), every read
    # row stepped, repeats from their distinct row's sum.
    if sort == "with-repeats":
        monkeypatch.setattr(rowwise, "SORTS_WITH_REPEATS_ON", frozenset({"cpu"}))
    results = []
    for stacked in (True, False):
        ebc = _collection(4, stacked)
        rows = RowWiseOptimizer(ebc.parameters(), RowWiseOptimizerConfig(optimizer, lr=0.1))
        for step in range(4):
            pooled_in_one_node(ebc, _batch(4, seed=step)).square().sum().backward()
            rows.step()
        results.append(([w.detach().clone() for w in ebc.parameters()], rows.state_dict()))
    (stacked_weights, stacked_state), (apart_weights, apart_state) = results
    for got, want in zip(stacked_weights, apart_weights):
        assert torch.equal(got, want)
    for got, want in zip(stacked_state["state"].values(), apart_state["state"].values()):
        for key in want:
            assert torch.equal(got[key], want[key]), key


def _ops_of_a_step(num_tables: int, stacked: bool, hand_over: bool = False) -> int:
    ebc = _collection(num_tables, stacked)
    optimizer = RowWiseOptimizer(ebc.parameters(), RowWiseOptimizerConfig("rowwise_adagrad"))
    counts = []
    for step in range(3):
        features = _batch(num_tables, seed=step)
        counter = _CountOps()
        with counter:
            pooled_in_one_node(ebc, features, optimizer.add_row_gradients if hand_over else None).sum().backward()
            optimizer.step()
        counts.append(counter.count)
    return max(counts[1:])  # the first step builds the optimizer's state


def test_autos_step_ops_do_not_grow_with_stacked_tables_sorted_as_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rowwise, "SORTS_WITH_REPEATS_ON", frozenset({"cpu"}))
    assert _ops_of_a_step(26, stacked=True, hand_over=True) == _ops_of_a_step(8, stacked=True, hand_over=True)


def test_autos_step_ops_do_not_grow_with_stacked_tables() -> None:
    # Lookup, backward and row-wise step of `auto`'s plain tables, their gradient rows handed to
    # the optimizer as one piece (a fit's way): the same kernels for 8 tables as for 26, and
    # nothing else either. As each table's .grad, a table adds its sparse gradient: built over
    # views of one gather (no kernel), checked for coalescing (metadata), and cloned by
    # autograd's accumulation under a dispatch mode only (the mode holds references; without
    # one the gradient is taken as it is). With the tables apart each also adds a lookup and a
    # gather of its rows.
    per_table_gradient = 3
    assert _ops_of_a_step(26, stacked=True, hand_over=True) == _ops_of_a_step(8, stacked=True, hand_over=True)
    grown = _ops_of_a_step(26, stacked=True) - _ops_of_a_step(8, stacked=True)
    grown_apart = _ops_of_a_step(26, stacked=False) - _ops_of_a_step(8, stacked=False)
    assert 0 < grown <= per_table_gradient * (26 - 8)
    assert grown_apart >= (per_table_gradient + 2) * (26 - 8)


def test_a_tables_sparse_gradient_is_the_lookups_own_memory() -> None:
    # What the op count above takes on trust: autograd keeps the gradient the lookup built (no copy).
    ebc = _collection(3)
    built = []  # addresses only: a reference held here would make autograd copy the gradient

    def sparse_coo_tensor(*args, **kwargs):
        grad = original(*args, **kwargs)
        built.append(grad._values().data_ptr())
        return grad

    original = torch.sparse_coo_tensor
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "sparse_coo_tensor", sparse_coo_tensor)
        pooled_in_one_node(ebc, _batch(3)).sum().backward()
    assert [bag.weight.grad._values().data_ptr() for bag in ebc.embedding_bags.values()] == built


def test_tables_turned_back_into_torchrecs_are_one_stack() -> None:
    # `to_torchrec` after a hotcache fit: the zoo's model then runs `auto`'s stacked path.
    from test_step_ops import _module

    from lightning_hotcache.embedding import to_torchrec

    hot_cold = _module(3)
    plain = to_torchrec(hot_cold)
    assert stacked_rows(list(plain.parameters())) is not None
    for name, value in hot_cold.state_dict().items():
        assert torch.equal(plain.state_dict()[name], value), name


def test_a_zoo_model_with_stacked_tables_exports() -> None:
    # torch.export traces fake tensors, which have no addresses: the tables trace apart.
    from models import DLRM

    dm = tiny_synthetic()
    dm.setup("fit")
    torch.manual_seed(0)
    model = DLRM(tables=dm.tables, num_dense_features=dm.num_dense_features)
    batch = dm.source("train").batch(0, 16)
    exported = torch.export.export(model, (batch.dense_features, batch.sparse_features), strict=False)
    expected = model(batch.dense_features, batch.sparse_features)
    torch.testing.assert_close(exported.module()(batch.dense_features, batch.sparse_features), expected)


def test_the_row_step_on_the_stack_waits_for_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # Counted on the CPU as CUDA would wait. On CUDA a stack's rows are sorted with repeats
    # kept (`SORTS_WITH_REPEATS_ON`): nothing is read. Sorted to distinct rows (the CPU's way,
    # its bitmap of the rows aside), the step reads their count (a sort's output size); tables
    # apart also read where each table's rows end among them, to split them, on every device.
    from test_step_ops import _CountSyncPoints

    monkeypatch.setattr(sorting, "MARKS_UP_TO_ROWS", 0)
    reads = {}
    for repeats, stacked, hand_over in itertools.product((True, False), repeat=3):
        ebc = _collection(4, stacked)
        optimizer = RowWiseOptimizer(ebc.parameters(), RowWiseOptimizerConfig("rowwise_adagrad"))
        pooled_in_one_node(ebc, _batch(4), optimizer.add_row_gradients if hand_over else None).sum().backward()
        with monkeypatch.context() as patch, _CountSyncPoints() as counter:
            if repeats:
                patch.setattr(rowwise, "SORTS_WITH_REPEATS_ON", frozenset({"cpu"}))
            optimizer.step()
        # `put_rows` writes host tables through numpy views: on the CPU only (CUDA's is index_copy_).
        reads[repeats, stacked, hand_over] = {name: count for name, count in counter.calls.items() if name != "numpy"}
    for hand_over in (True, False):
        assert reads[True, True, hand_over] == {}
        assert reads[False, True, hand_over] == {"aten._unique2.default": 1}
        for repeats in (True, False):
            assert reads[repeats, False, hand_over] == {"aten._unique2.default": 1, "tolist": 1}
