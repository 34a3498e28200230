"""TorchRec's EmbeddingBagCollection looked up in one autograd node (`pooled_in_one_node`): what
the zoo's models run under ``auto``, ``ddp`` and ``sparse_ddp`` gives TorchRec's output and
gradients, trains what TorchRec's own forward trains, takes the path for the zoo's batches, and
leaves every collection or batch it does not reproduce to the module.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from conftest import cpu_trainer, tiny_synthetic
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import DataType, PoolingType

from lightning_hotcache.embedding import torchrec_lookup
from lightning_hotcache.embedding.torchrec_lookup import pooled_in_one_node
from lightning_hotcache.optim.rowwise import use_sparse_gradients
from lightning_hotcache.optim.stacked_tables import stack_tables, stacked_rows
from models import DLRM, DeepFM

# t_a is read by two features; t_b by one.
TABLES = [
    EmbeddingBagConfig(name="t_a", num_embeddings=50, embedding_dim=8, feature_names=["a1", "a2"]),
    EmbeddingBagConfig(name="t_b", num_embeddings=7, embedding_dim=8, feature_names=["b"]),
]
KEYS = ["a1", "a2", "b"]
BATCH = 6


def collection(
    pooling: PoolingType = PoolingType.SUM, weighted: bool = False, tables=TABLES, stacked: bool = False
) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(**{**t.__dict__, "pooling": pooling}) for t in tables], is_weighted=weighted
    )
    use_sparse_gradients(ebc)
    if stacked:
        stack_tables(ebc)
    return ebc


def unstacked(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every table in memory of its own, as TorchRec makes them."""
    for bag in model.modules():
        if isinstance(bag, torch.nn.EmbeddingBag):
            bag.weight.data = bag.weight.data.clone()
    return model


def batch(seed: int = 0, weighted: bool = False, keys: list[str] = KEYS) -> KeyedJaggedTensor:
    """0 to 3 ids a bag (empty bags included), many repeated."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * BATCH,), generator=g)
    lengths[0] = 0
    rows = {"a1": 50, "a2": 50, "b": 7}
    values = torch.cat(
        [torch.randint(0, rows[k], (int(n),), generator=g) for k, n in zip(keys, lengths.view(len(keys), BATCH).sum(1))]
    )
    weights = torch.rand(len(values), generator=g) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights).sync()


@pytest.mark.parametrize("stacked", [False, True], ids=["tables apart", "tables stacked"])
@pytest.mark.parametrize(
    ("pooling", "weighted"), [(PoolingType.SUM, False), (PoolingType.SUM, True), (PoolingType.MEAN, False)]
)
def test_output_and_gradients_are_torchrecs(
    pooling: PoolingType, weighted: bool, stacked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    ebc = collection(pooling, weighted, stacked=stacked)
    reference = unstacked(copy.deepcopy(ebc))
    features = batch(weighted=weighted)
    lookups = []
    original = torch.nn.functional.embedding_bag
    monkeypatch.setattr(torch.nn.functional, "embedding_bag", lambda *a, **k: lookups.append(1) or original(*a, **k))
    pooled = pooled_in_one_node(ebc, features)
    # Stacked tables: one lookup over the stack for every feature; else one a feature.
    assert len(lookups) == (1 if stacked else len(KEYS))
    monkeypatch.undo()
    expected = reference(features).values()
    assert pooled is not None and torch.equal(pooled, expected)
    upstream = torch.randn_like(expected)
    pooled.backward(upstream)
    expected.backward(upstream)
    got, want = ebc.embedding_bags["t_b"].weight.grad, reference.embedding_bags["t_b"].weight.grad
    # A table of one feature: TorchRec's sparse gradient, id for id and row for row.
    assert got.is_sparse and not got.is_coalesced()
    assert torch.equal(got._indices(), want._indices()) and torch.equal(got._values(), want._values())
    # A table of two: the same sums (autograd's accumulation of TorchRec's two gradients
    # interleaves them and adds some duplicates early; here they come feature by feature).
    got, want = ebc.embedding_bags["t_a"].weight.grad, reference.embedding_bags["t_a"].weight.grad
    assert got._indices().shape[1] == int(features.length_per_key()[0] + features.length_per_key()[1])
    torch.testing.assert_close(got.coalesce(), want.coalesce(), rtol=1e-6, atol=1e-7)


def test_a_frozen_table_gets_no_gradient() -> None:
    ebc = collection()
    ebc.embedding_bags["t_a"].weight.requires_grad_(False)
    pooled = pooled_in_one_node(ebc, batch())
    pooled.sum().backward()
    assert ebc.embedding_bags["t_a"].weight.grad is None and ebc.embedding_bags["t_b"].weight.grad is not None


def _keyed_per_feature(ebc: EmbeddingBagCollection) -> EmbeddingBagCollection:
    class Subclass(EmbeddingBagCollection):
        pass

    return Subclass(tables=ebc.embedding_bag_configs())


@pytest.mark.parametrize(
    "case",
    [
        "keys in another order",
        "a key more",
        "dense gradients",
        "a subclass",
        "two widths",
        "mixed pooling",
        "a shared feature",
        "half precision",
        "max_norm",
    ],
)
def test_what_it_does_not_reproduce_is_left_to_the_module(case: str) -> None:
    ebc, features = collection(), batch()
    if case == "keys in another order":
        features = batch(keys=["a2", "a1", "b"])
    elif case == "a key more":
        features = batch(keys=[*KEYS, "a1"])
    elif case == "dense gradients":
        ebc.embedding_bags["t_b"].sparse = False
    elif case == "a subclass":
        ebc = _keyed_per_feature(ebc)
        use_sparse_gradients(ebc)
    elif case == "two widths":
        ebc = collection(tables=[TABLES[0], EmbeddingBagConfig(name="t_b", num_embeddings=7, embedding_dim=4, feature_names=["b"])])
    elif case == "mixed pooling":
        ebc = EmbeddingBagCollection(tables=[TABLES[0], EmbeddingBagConfig(**{**TABLES[1].__dict__, "pooling": PoolingType.MEAN})])
        use_sparse_gradients(ebc)
    elif case == "a shared feature":  # TorchRec keys its outputs "a1@t_a", "a1@t_b"
        ebc = collection(tables=[TABLES[0], EmbeddingBagConfig(name="t_b", num_embeddings=7, embedding_dim=8, feature_names=["a1"])])
    elif case == "half precision":
        ebc = collection(tables=[EmbeddingBagConfig(**{**t.__dict__, "data_type": DataType.FP16}) for t in TABLES])
    elif case == "max_norm":
        ebc.embedding_bags["t_a"].max_norm = 1.0
    assert pooled_in_one_node(ebc, features) is None


def test_a_batch_size_per_feature_is_left_to_the_module() -> None:
    vbe = KeyedJaggedTensor(
        keys=KEYS,
        values=torch.tensor([1, 2, 3, 4, 5]),
        lengths=torch.tensor([1, 1, 1, 1, 1]),
        stride_per_key_per_rank=[[2], [2], [1]],
        inverse_indices=(KEYS, torch.tensor([[0, 1], [0, 1], [0, 0]])),
    )
    assert pooled_in_one_node(collection(), vbe) is None


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("model_class", [DLRM, DeepFM])
def test_the_zoo_trains_what_torchrecs_forward_trains(model_class: type, accumulate: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # DeepFM: its first-order weights are a collection of their own, looked up the same way.
    def fit(one_node: bool, stacked: bool = True, hand_over: bool = True) -> dict[str, torch.Tensor]:
        calls, sinks = [], []
        original = torchrec_lookup.pooled_in_one_node

        def counted(ebc, features, gradient_rows_to=None, pooled_gradients_to=None):
            sinks.append(gradient_rows_to is not None)
            found = original(ebc, features, gradient_rows_to if hand_over else None, pooled_gradients_to) if one_node else None
            calls.append(found is not None)
            return found

        monkeypatch.setattr("models.base.pooled_in_one_node", counted)
        monkeypatch.setattr("models.first_order.pooled_in_one_node", counted)
        torch.manual_seed(0)
        data = tiny_synthetic()
        model = model_class(tables=data.tables, num_dense_features=data.num_dense_features)
        if not stacked:
            unstacked(model)
        cpu_trainer(max_steps=6, limit_val_batches=0, accumulate_grad_batches=accumulate).fit(model, data)
        assert calls and all(calls) == one_node
        assert all(sinks), "a fit's training steps hand the tables' gradient rows to the row-wise optimizer"
        assert (stacked_rows(list(model.sparse_arch.embedding_bag_collection.parameters())) is not None) == stacked
        return model.state_dict()

    # TorchRec's forward on tables apart (the row-wise step table by table) is the reference;
    # the one-node lookup over the zoo's stacked tables (the step on the stack) and over tables
    # apart give the same weights, their gradient rows handed to the optimizer as one piece (a
    # fit's way) or as each table's .grad: one feature a table, the same sums in the same order.
    # Over micro-batches, autograd adds a table's sparse gradients by merging their index lists
    # (torch's sparse add: ids met at the same time are summed first), where the optimizer
    # sums the handed-over pieces id by id in order: equal to the last bits of a sum then.
    reference = fit(False, stacked=False)
    results = {(stacked, hand_over): fit(True, stacked, hand_over) for stacked in (True, False) for hand_over in (True, False)}
    for (_, hand_over), result in results.items():
        assert result.keys() == reference.keys()
        for key in result:
            if accumulate > 1 and hand_over:
                torch.testing.assert_close(result[key], reference[key], rtol=1e-5, atol=1e-6, msg=key)
            else:
                assert torch.equal(result[key], reference[key]), key


def test_a_strategys_tables_output_in_another_order_is_picked_out_by_name() -> None:
    # Sharding may reorder a collection's outputs; in order (hot/cold tables) they pass as they are.
    from torchrec import KeyedTensor

    data = tiny_synthetic()
    data.setup("fit")
    model = DLRM(tables=data.tables, num_dense_features=data.num_dense_features)
    features = data.source("train").batch(0, 16).sparse_features
    plain = model.sparse_arch.embedding_bag_collection
    expected = model.sparse_arch(features)  # TorchRec's SparseArch

    class Reordered(torch.nn.Module):
        def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
            keyed = plain(features)
            keys = keyed.keys()[::-1]
            return KeyedTensor.from_tensor_list(keys, [keyed[key] for key in keys])

    model.sparse_arch.embedding_bag_collection = Reordered()
    assert torch.equal(model.embed(features), expected)


def test_a_fits_tables_get_no_sparse_gradient_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # Their gradient rows reach the row-wise optimizer as one piece: no sparse tensor and no
    # autograd accumulation per table (~45 us of host time each on a GPU's host).
    built = []
    original = torch.sparse_coo_tensor
    monkeypatch.setattr(torch, "sparse_coo_tensor", lambda *args, **kwargs: built.append(1) or original(*args, **kwargs))
    seen = []

    class TableGradients(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
            seen.append([p.grad for p in module.embedding_parameters()])

    data = tiny_synthetic()
    model = DeepFM(tables=data.tables, num_dense_features=data.num_dense_features)
    cpu_trainer(max_steps=3, limit_val_batches=0, callbacks=[TableGradients()]).fit(model, data)
    assert len(seen) == 3 and all(grad is None for grads in seen for grad in grads)
    assert not built
    # Outside a fit, a backward gives each table its sparse gradient, as TorchRec's forward does.
    batch = data.source("train").batch(0, 8)
    model(batch.dense_features, batch.sparse_features).sum().backward()
    assert all(p.grad is not None and p.grad.is_sparse for p in model.embedding_parameters())


def test_gradients_left_by_a_stopped_fit_do_not_reach_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fit stopped between a backward and its step leaves that batch's gradients with the
    # optimizer (handed over) or the tables (.grad); the next fit starts without them.
    def fit(stale: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        data = tiny_synthetic()
        model = DLRM(tables=data.tables, num_dense_features=data.num_dense_features)
        if stale:
            tables = model.embedding_parameters()
            model.embedding_optimizer.add_row_gradients(tables, torch.tensor([0, 1]), torch.ones(2, tables[0].shape[1]))
            batch = data.source("train").batch(0, 8)
            model(batch.dense_features, batch.sparse_features).sum().backward()
        cpu_trainer(max_steps=2, limit_val_batches=0).fit(model, data)
        return {k: v for k, v in model.state_dict().items() if "embedding_bags" in k}

    clean, after_stale = fit(False), fit(True)
    for key in clean:
        assert torch.equal(after_stale[key], clean[key]), key
