"""TorchRec's EmbeddingBagCollection contract, held by the hot/cold module.

In the spirit of TorchRec's own tests (torchrec/modules/tests/test_embedding_modules.py and
test_fused_embedding_modules.py): every case builds a TorchRec `EmbeddingBagCollection`,
swaps in `HotColdEmbeddingBagCollection.from_ebc` with all rows on the device, a small
device tier, and none (every row cached from the host), on FBGEMM's kernel and PyTorch's, and
checks what a user of the EBC would see: outputs, keys, ``length_per_key``, ``state_dict``,
weighted and MEAN bags, tables read by several features, features read by several tables
(``feature@table`` keys), empty bags, a batch of one, and training equal to TorchRec's
in-backward optimizer. What the module does not support (a batch size per feature) is refused
with an error that says so; what it does not have (``embedding_bags``) says what to use.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_embedding_exactness import make_plan, reference_state, train_reference
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

from lightning_hotcache import RowWiseOptimizerConfig, to_torchrec
from lightning_hotcache.embedding import HotColdEmbeddingBagCollection

# "s" is read by two tables (TorchRec names those outputs s@t_a and s@t_b); t_b is read by two features.
TABLES = [
    EmbeddingBagConfig(name="t_a", num_embeddings=60, embedding_dim=8, feature_names=["f1", "s"]),
    EmbeddingBagConfig(name="t_b", num_embeddings=40, embedding_dim=8, feature_names=["f2", "s"]),
    EmbeddingBagConfig(name="t_c", num_embeddings=30, embedding_dim=4, feature_names=["f3"]),
]
KEYS = ["f1", "s", "f2", "s", "f3"]
PLANS = {"all-on-device": 1.0, "small": 0.1, "all-cold": None}
KERNELS = ("fbgemm", "pytorch")
BATCH = 6


def batches(steps: int = 4, batch: int = BATCH, seed: int = 0, weighted: bool = False) -> list[KeyedJaggedTensor]:
    """Bags of 0 to 3 ids per feature (empty bags included), ids of the smaller table that reads a key."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        keys = ["f1", "s", "f2", "f3"]
        lengths = torch.randint(0, 4, (len(keys) * batch,), generator=g)
        lengths[0] = 0  # always one empty bag
        limits = {"f1": 60, "s": 40, "f2": 40, "f3": 30}
        values = torch.cat([torch.randint(0, limits[k], (int(n),), generator=g) for k, n in zip(keys, lengths.view(len(keys), batch).sum(1))])
        weights = torch.rand(len(values), generator=g) + 0.5 if weighted else None
        out.append(KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths, weights=weights))
    return out


def tables_with(pooling: PoolingType) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(**{**t.__dict__, "pooling": pooling}) for t in TABLES]


def swapped(ebc: EmbeddingBagCollection, plan_name: str, kernel: str, config: RowWiseOptimizerConfig | None = None, data=None):
    """``ebc`` swapped for the hot/cold module, its cache slots sized for ``data``'s batches."""
    plan = make_plan(data or batches(), PLANS[plan_name], 0, "lfu", ebc.embedding_bag_configs())
    return HotColdEmbeddingBagCollection.from_ebc(ebc, plan, config or RowWiseOptimizerConfig("sgd"), kernel=kernel)


CASES = list(itertools.product(PLANS, KERNELS))


@pytest.mark.parametrize(("plan", "kernel"), CASES)
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_outputs_keys_and_lengths_are_the_ebcs(plan: str, kernel: str, pooling: PoolingType, weighted: bool) -> None:
    if weighted and pooling == PoolingType.MEAN:
        pytest.skip("TorchRec weighs SUM bags only")
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=tables_with(pooling), is_weighted=weighted)
    module = swapped(ebc, plan, kernel)
    assert module.is_weighted() == ebc.is_weighted() and module.embedding_bag_configs() == ebc.embedding_bag_configs()
    for batch in batches(weighted=weighted) + batches(steps=1, batch=1, seed=5, weighted=weighted):
        with torch.no_grad():
            got, expected = module(batch), ebc(batch)
        assert got.keys() == expected.keys() == ["f1", "s@t_a", "f2", "s@t_b", "f3"]
        assert got.length_per_key() == expected.length_per_key()
        torch.testing.assert_close(got.values(), expected.values())
        torch.testing.assert_close(got["s@t_a"], expected["s@t_a"])


@pytest.mark.parametrize(("plan", "kernel"), CASES)
def test_state_dict_is_the_ebcs(plan: str, kernel: str) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=TABLES)
    module = swapped(ebc, plan, kernel)
    assert list(module.state_dict()) == list(ebc.state_dict()) == [f"embedding_bags.{t.name}.weight" for t in TABLES]
    torch.testing.assert_close(module.state_dict(), ebc.state_dict())
    other = EmbeddingBagCollection(tables=TABLES)
    module.load_state_dict(other.state_dict())
    torch.testing.assert_close(module.state_dict(), other.state_dict())


@pytest.mark.parametrize(("plan", "kernel"), CASES)
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_training_is_torchrecs_in_backward_optimizer(plan: str, kernel: str, optimizer: str) -> None:
    config = RowWiseOptimizerConfig(optimizer, lr=0.1)
    data = batches(steps=6, weighted=True)
    width = sum(t.embedding_dim * len(t.feature_names) for t in TABLES)
    upstream = [torch.randn(BATCH, width, generator=torch.Generator().manual_seed(i)) for i in range(len(data))]
    reference = train_reference(config, data, upstream, TABLES, weighted=True)
    torch.manual_seed(0)
    module = swapped(EmbeddingBagCollection(tables=TABLES, is_weighted=True), plan, kernel, config, data)
    for batch, grad in zip(data, upstream):
        module(batch).values().backward(grad)
    torch.testing.assert_close(module.state_dict(), reference.state_dict(), rtol=1e-5, atol=1e-6)
    expected = reference_state(reference)
    for name, arrays in module.optimizer_state().items():
        for key, value in arrays.items():
            torch.testing.assert_close(value, expected[name][key], rtol=1e-5, atol=1e-6, msg=f"{name}.{key}")


def test_a_batch_size_per_feature_is_refused() -> None:
    # TorchRec's variable batch per feature (VBE): stride_per_key_per_rank and inverse_indices.
    module = swapped(EmbeddingBagCollection(tables=TABLES), "small", "fbgemm")
    vbe = KeyedJaggedTensor(
        keys=["f1", "s", "f2", "f3"],
        values=torch.tensor([1, 2, 3, 4, 5, 6, 7]),
        lengths=torch.tensor([1, 1, 1, 1, 1, 1, 1]),
        stride_per_key_per_rank=[[2], [2], [1], [2]],
        inverse_indices=(["f1", "s", "f2", "f3"], torch.tensor([[0, 1], [0, 1], [0, 0], [0, 1]])),
    )
    with pytest.raises(ValueError, match="batch size per feature.*does not support"):
        module(vbe)


def test_embedding_bags_says_what_to_use_and_reset_parameters_reinitializes() -> None:
    module = swapped(EmbeddingBagCollection(tables=TABLES), "small", "fbgemm")
    with pytest.raises(AttributeError, match="no embedding_bags.*state_dict.*to_torchrec"):
        module.embedding_bags["t_a"].weight
    before = {k: v.clone() for k, v in module.state_dict().items()}  # state_dict shares memory, as nn.Module's
    module.reset_parameters(seed=3)
    after = {k: v.clone() for k, v in module.state_dict().items()}
    assert not torch.equal(before["embedding_bags.t_a.weight"], after["embedding_bags.t_a.weight"])
    module.reset_parameters(seed=3)
    torch.testing.assert_close(module.state_dict(), after)  # the seed decides


class _Model(torch.nn.Module):
    """A model that takes tensors (what torch.export traces) and builds the KJT inside."""

    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.head = torch.nn.Linear(sum(t.embedding_dim * len(t.feature_names) for t in TABLES), 1)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        features = KeyedJaggedTensor(keys=["f1", "s", "f2", "f3"], values=values, lengths=lengths)
        return self.head(self.ebc(features).values())


@pytest.mark.parametrize("kernel", KERNELS)
def test_trained_model_goes_back_to_torchrec_and_exports(kernel: str) -> None:
    config = RowWiseOptimizerConfig("rowwise_adagrad", lr=0.1)
    torch.manual_seed(0)
    model = _Model(swapped(EmbeddingBagCollection(tables=TABLES), "small", kernel, config))
    data = batches(steps=4)
    for batch in data:
        model(batch.values(), batch.lengths()).sum().backward()
    trained = model.ebc.state_dict()
    with torch.no_grad():
        before = [model(b.values(), b.lengths()) for b in data]
    plain = to_torchrec(model)
    assert plain is model and type(model.ebc) is EmbeddingBagCollection
    torch.testing.assert_close(model.ebc.state_dict(), trained)
    with torch.no_grad():
        torch.testing.assert_close([model(b.values(), b.lengths()) for b in data], before)
    batch = data[0]
    exported = torch.export.export(model, (batch.values(), batch.lengths()), strict=False)
    torch.testing.assert_close(exported.module()(batch.values(), batch.lengths()), before[0])


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_trained_model_deep_copies_and_pickles_as_torchrec(kernel: str, tmp_path) -> None:
    # Issue 29 item 19: copy.deepcopy (EMA, SWA, model soups) and torch.save(model) failed on the
    # module's lock. A copy is a TorchRec collection with the current weights; the original trains on.
    import copy
    import pickle

    config = RowWiseOptimizerConfig("rowwise_adagrad", lr=0.1)
    torch.manual_seed(0)
    model = _Model(swapped(EmbeddingBagCollection(tables=TABLES), "small", kernel, config))
    data = batches(steps=4)
    for batch in data[:2]:
        model(batch.values(), batch.lengths()).sum().backward()
    with torch.no_grad():
        before = [model(b.values(), b.lengths()) for b in data]
    torch.save(model, tmp_path / "model.pt")
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(tmp_path / "model.pt", weights_only=False)):
        assert type(copied.ebc) is EmbeddingBagCollection
        torch.testing.assert_close(copied.ebc.state_dict(), model.ebc.state_dict())
        with torch.no_grad():
            torch.testing.assert_close([copied(b.values(), b.lengths()) for b in data], before)
    assert isinstance(model.ebc, HotColdEmbeddingBagCollection)
    for batch in data[2:]:  # the original keeps training
        model(batch.values(), batch.lengths()).sum().backward()
