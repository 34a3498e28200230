"""The zoo: every model trains, learns, keeps the embedding/dense split, and checkpoints."""

from __future__ import annotations

import inspect
import warnings

import lightning.pytorch as pl
import pytest
import torch
from conftest import UserModel, cpu_trainer, tiny_synthetic
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from lightning_hotcache import HotCacheStrategy
from models import DLRM, MODEL_REGISTRY, CTRModel, create_model
from models.first_order import FIRST_ORDER_SUFFIX

MODEL_NAMES = sorted(MODEL_REGISTRY)


def _model(name: str, dm, **kwargs) -> CTRModel:
    return create_model(name, dm.tables, dm.num_dense_features, **kwargs)


def _embedding_weights(model: CTRModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "embedding_bags" in k}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_backward(name: str) -> None:
    dm = tiny_synthetic()
    model = _model(name, dm)
    batch = dm.source("train").batch(0, 32)
    logits = model(batch.dense_features, batch.sparse_features)
    assert logits.shape == (32,)
    model.loss_fn(logits, batch.labels).mean().backward()
    assert all(p.grad is not None and p.grad.is_sparse for p in model.embedding_parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.dense_parameters())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_validation_loss_goes_down(name: str) -> None:
    pl.seed_everything(0)
    dm = tiny_synthetic(num_train_samples=8192, shuffle=True)
    model = _model(name, dm, dense_lr=3e-3)
    before = cpu_trainer().validate(model, dm, verbose=False)[0]["val/logloss"]
    cpu_trainer(max_epochs=2).fit(model, dm)
    after = cpu_trainer().validate(model, dm, verbose=False)[0]
    assert after["val/logloss"] < before - 0.01
    assert after["val/auc"] > 0.6
    assert 0.6 < after["val/bayes_auc"] < 1.0


def test_validation_under_a_distributed_strategy_warns_of_no_unsynced_figure() -> None:
    """hotcache runs torch.distributed even in one process, where Lightning warns of every
    epoch-level figure logged without a sync: the zoo's reference figures are synced (as
    the max of equal values), so a user's validation prints no such warning."""
    dm = tiny_synthetic(num_train_samples=256, num_val_samples=256, batch_size=64)
    model = _model("dlrm", dm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = cpu_trainer(strategy=HotCacheStrategy(device_budget=1.0, profile_batches=2)).validate(model, dm, verbose=False)[0]
    assert metrics["val/bayes_auc"] == dm.reference_metrics("val")["bayes_auc"]
    assert not [str(w.message) for w in caught if "sync_dist" in str(w.message)]


@pytest.mark.parametrize("strategy", ["auto", "hotcache", "torchrec"])
def test_precision_casting_the_tables_to_half_is_a_clear_error(strategy: str) -> None:
    """The tables stay float32 under every strategy; "bf16-true" failed deep in the dense layers
    ("mat1 and mat2 must have the same dtype"), under `auto` too. Refused up front, naming the
    mixed precision that trains."""
    dm = tiny_synthetic(num_train_samples=256, batch_size=64)
    with pytest.raises(ValueError, match=r"precision='bf16-true'.*Use precision='bf16-mixed'"):
        cpu_trainer(strategy=strategy, precision="bf16-true", max_steps=1).fit(_model("dlrm", dm), dm)


def test_a_user_model_under_hotcache_at_half_precision_is_a_clear_error() -> None:
    """Not the zoo's refusal: the strategy's own, for any model with tables."""
    dm = tiny_synthetic(num_train_samples=256, batch_size=64)
    with pytest.raises(ValueError, match=r"strategy='hotcache' keeps the embedding tables.*float32"):
        cpu_trainer(strategy="hotcache", precision="bf16-true", max_steps=1).fit(UserModel(dm.tables), dm)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_only_looked_up_rows_move(optimizer: str) -> None:
    dm = tiny_synthetic(num_train_samples=256)
    model = _model("dlrm", dm, embedding_optimizer={"name": optimizer, "lr": 0.1})
    _train_one_step_and_check_moved_rows(model, dm, "sparse_arch.embedding_bag_collection.embedding_bags.{}.weight")


def _train_one_step_and_check_moved_rows(model: CTRModel, dm, key_format: str) -> dict[str, torch.Tensor]:
    """One training step on the first 256 samples; exactly the rows that batch read have
    moved in each table (its weight found at ``key_format.format(table name)``). Returns the
    weights after the step."""
    before = _embedding_weights(model)
    batch = dm.source("train").batch(0, 256)
    cpu_trainer(max_steps=1).fit(model, dm)
    after = _embedding_weights(model)
    for config, feature in zip(dm.tables, batch.sparse_features.keys()):
        key = key_format.format(config.name)
        looked_up = torch.zeros(config.num_embeddings, dtype=torch.bool)
        looked_up[batch.sparse_features[feature].values()] = True
        assert torch.equal((after[key] != before[key]).any(dim=1), looked_up), config.name
    return after


def test_dense_optimizer_excludes_embeddings() -> None:
    dm = tiny_synthetic()
    model = _model("dlrm", dm)
    optimizer = model.configure_optimizers()
    in_dense = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_dense.isdisjoint(id(p) for p in model.embedding_parameters())
    assert len(in_dense) == len(model.dense_parameters()) > 0


def test_dense_adam_is_fused_where_torch_has_the_kernel() -> None:
    dm = tiny_synthetic()
    assert _model("dlrm", dm).configure_optimizers().defaults["fused"] is True
    # A device torch has no fused Adam for keeps torch's default, not an error at fit start.
    model = _model("dlrm", dm).to("meta")
    assert model.configure_optimizers().defaults["fused"] is None


# The models with an MLP tower; LR and FM have none, so they take no `dropout`.
DEEP_MODEL_NAMES = [name for name in MODEL_NAMES if name not in ("lr", "fm")]


@pytest.mark.parametrize("name", DEEP_MODEL_NAMES)
def test_dropout_acts_in_training_only(name: str) -> None:
    dm = tiny_synthetic()
    batch = dm.source("train").batch(0, 64)
    plain = _model(name, dm)
    dropped = _model(name, dm, dropout=0.5)
    # Dropout has no parameters: same state, same keys, so checkpoints load either way.
    dropped.load_state_dict(plain.state_dict())

    def logits(model: CTRModel, seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return model(batch.dense_features, batch.sparse_features).detach()

    plain.train(), dropped.train()
    assert torch.equal(logits(plain, 0), logits(plain, 1))
    assert not torch.allclose(logits(dropped, 0), logits(plain, 0))
    assert not torch.allclose(logits(dropped, 0), logits(dropped, 1))  # a fresh mask per step
    plain.eval(), dropped.eval()
    assert torch.equal(logits(dropped, 0), logits(plain, 0))


def test_dropout_out_of_range_is_a_clear_error() -> None:
    dm = tiny_synthetic()
    for bad in (-0.1, 1.0):
        for name in ("deepfm", "dlrm"):
            with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
                _model(name, dm, dropout=bad)


@pytest.mark.parametrize("name", ["dlrm", "fm"])
def test_dense_weight_decay_pulls_dense_weights_to_zero(name: str) -> None:
    """With zero gradients Adam does not move a weight; with weight decay the gradient is
    ``decay * w``, and Adam's first step ``lr * g / (|g| + eps)`` moves every weight to zero."""
    dm = tiny_synthetic()
    for decay in (0.0, 0.1):
        model = _model(name, dm, dense_lr=0.01, dense_weight_decay=decay)
        optimizer = model.configure_optimizers()
        before = [p.detach().clone() for p in model.dense_parameters()]
        for p in model.dense_parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for old, new in zip(before, model.dense_parameters()):
            gradient = decay * old
            expected = old - 0.01 * gradient / (gradient.abs() + 1e-8)
            torch.testing.assert_close(new.detach(), expected)
    with pytest.raises(ValueError, match=r"dense_weight_decay must be >= 0"):
        _model(name, dm, dense_weight_decay=-1e-4)


def _squared_norms_by_hand(model: CTRModel, sparse: KeyedJaggedTensor) -> torch.Tensor:
    """Per sample, over every feature of every table the model has: the squared norm of the
    feature's SUM-pooled rows, a first-order row counting as its weight (the mean of its columns)."""
    total = torch.zeros(sparse.stride())
    for collection in (m for m in model.modules() if isinstance(m, EmbeddingBagCollection)):
        for config in collection.embedding_bag_configs():
            rows = collection.embedding_bags[config.name].weight.detach()
            if config.name.endswith(FIRST_ORDER_SUFFIX):
                rows = rows.mean(dim=1, keepdim=True)
            for feature in config.feature_names:
                ids, lengths = sparse[feature].values(), sparse[feature].lengths()
                samples = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
                pooled = torch.zeros(len(lengths), rows.shape[1]).index_add_(0, samples, rows[ids])
                total += pooled.square().sum(dim=1)
    return total


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_embedding_l2_adds_its_penalty_to_the_training_loss(name: str) -> None:
    """One step's training loss with embedding_l2 is the loss without plus embedding_l2 times the
    batch's mean squared norm of what it read (pooled embeddings and per-id weights), by hand."""
    dm = tiny_synthetic(num_train_samples=256)
    sparse = dm.source("train").batch(0, 256).sparse_features  # the one training batch
    losses, norms = {}, {}
    for l2 in (0.0, 0.5):
        pl.seed_everything(0)
        model = _model(name, dm, embedding_l2=l2)
        if model.uses_first_order:
            with torch.no_grad():  # per-id weights start at zero: make them count (a row's columns stay equal)
                for bag in model.first_order_arch.embedding_bag_collection.parameters():
                    bag.copy_(torch.randn(bag.shape[0], 1).expand_as(bag))
        norms[l2] = _squared_norms_by_hand(model, sparse).mean()
        trainer = cpu_trainer(max_steps=1)
        trainer.fit(model, dm)
        losses[l2] = trainer.callback_metrics["train/loss"]
    assert norms[0.5] == norms[0.0] > 0
    torch.testing.assert_close(losses[0.5] - losses[0.0], 0.5 * norms[0.5], rtol=1e-5, atol=1e-6)


def test_embedding_l2_is_learned_the_same_under_hotcache() -> None:
    """The penalty is part of the loss, so rows split between device and host tiers learn it too."""

    def fit(strategy: str | HotCacheStrategy, l2: float) -> dict[str, torch.Tensor]:
        pl.seed_everything(0)
        # Tables up to ~100k rows against batches of 64, so a 10% budget really splits them.
        dm = tiny_synthetic(scale=0.01, num_embeddings_cap=None, num_train_samples=512, batch_size=64)
        model = _model("deepfm", dm, embedding_l2=l2)  # both kinds of tables: dim-D and per-id weights
        cpu_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0).fit(model, dm)
        return model.state_dict()

    penalized = fit("auto", 0.05)
    table = "sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight"
    assert not torch.allclose(penalized[table], fit("auto", 0.0)[table])
    hotcache = HotCacheStrategy(device_budget=0.1, profile_batches=4)
    learned = fit(hotcache, 0.05)
    assert hotcache.plan is not None and any(not t.on_device for t in hotcache.plan.tables)
    torch.testing.assert_close(learned, penalized, rtol=1e-5, atol=1e-5)


def test_negative_embedding_l2_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"embedding_l2 must be >= 0"):
        _model("deepfm", tiny_synthetic(), embedding_l2=-1e-5)


def test_checkpoint_resume_matches_straight_through(tmp_path) -> None:
    """Plain path exactness: 2 epochs straight == 1 epoch, checkpoint, resume for 1 more
    (dense Adam state and row-wise Adagrad state both restored)."""
    dm = tiny_synthetic(num_train_samples=1024)

    def fresh() -> CTRModel:
        pl.seed_everything(0)
        return _model("dlrm", dm, embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.1})

    straight = fresh()
    cpu_trainer(max_epochs=2).fit(straight, dm)

    first = fresh()
    trainer = cpu_trainer(max_epochs=1)
    trainer.fit(first, dm)
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed = fresh()
    cpu_trainer(max_epochs=2).fit(resumed, dm, ckpt_path=tmp_path / "epoch1.ckpt")

    torch.testing.assert_close(resumed.state_dict(), straight.state_dict(), rtol=1e-5, atol=1e-7)

    # The checkpoint also loads stand-alone (weights_only: plain hyperparameters only).
    loaded = DLRM.load_from_checkpoint(tmp_path / "epoch1.ckpt")
    torch.testing.assert_close(loaded.state_dict(), first.state_dict())
    assert loaded.embedding_optimizer_config.name == "rowwise_adagrad"


def test_bad_tables_are_clear_errors() -> None:
    mixed = [
        EmbeddingBagConfig(name="a", num_embeddings=10, embedding_dim=8, feature_names=["fa"]),
        EmbeddingBagConfig(name="b", num_embeddings=10, embedding_dim=4, feature_names=["fb"]),
    ]
    with pytest.raises(ValueError, match="embedding_dim"):
        DLRM(mixed, 4)
    with pytest.raises(ValueError, match="at least one embedding table"):
        DLRM([], 4)
    with pytest.raises(ValueError, match="Unknown model"):
        create_model("wide_and_deep", mixed[:1], 4)


class _WidthFromAttribute(DLRM):
    """The usual PyTorch habit: set what the builders read after super().__init__()."""

    def __init__(self, tables, num_dense_features: int, head_width: int = 4, **kwargs) -> None:
        super().__init__(tables, num_dense_features, **kwargs)
        self.head_width = head_width
        self.head_dropout = torch.nn.Dropout(0.0)

    def build_over_arch(self, in_features: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(in_features, self.head_width), self.head_dropout,
                                   torch.nn.Linear(self.head_width, 1))  # fmt: skip


def test_subclass_builders_see_attributes_set_after_super_init(tmp_path) -> None:
    dm = tiny_synthetic()
    assert "head_width" in inspect.signature(_WidthFromAttribute).parameters
    model = _WidthFromAttribute(dm.tables, dm.num_dense_features, head_width=3)
    assert model.over_arch[0].out_features == 3 and model.over_arch[1] is model.head_dropout
    batch = dm.source("train").batch(0, 8)
    assert model(batch.dense_features, batch.sparse_features).shape == (8,)
    trainer = cpu_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(model, dm)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    loaded = _WidthFromAttribute.load_from_checkpoint(tmp_path / "model.ckpt")
    torch.testing.assert_close(loaded.state_dict(), model.state_dict())


class _ForgetsSuperOnFitStart(DLRM):
    def on_fit_start(self) -> None:
        pass  # should call super().on_fit_start()


def test_tables_found_once_a_fit_and_a_missing_super_call_is_a_clear_error() -> None:
    dm = tiny_synthetic()
    model = DLRM(dm.tables, dm.num_dense_features)
    before = {name: p.detach().clone() for name, p in model.named_parameters() if "embedding_bags" in name}
    cpu_trainer(max_steps=2, limit_val_batches=0).fit(model, dm)
    assert any(not torch.equal(before[name], p) for name, p in model.named_parameters() if name in before)  # rows stepped
    assert model._fit_tables is None  # forgotten after the fit: a later one may place the tables otherwise
    with pytest.raises(RuntimeError, match=r"must call super\(\).on_fit_start\(\)"):
        cpu_trainer(max_steps=1, limit_val_batches=0).fit(_ForgetsSuperOnFitStart(dm.tables, dm.num_dense_features), dm)


# ------------------------------------------- DLRM's interaction; xDeepFM, FinalMLP, DCN mixture
from torchrec.models.dlrm import InteractionArch  # noqa: E402

from models.interactions import (  # noqa: E402
    CINInteraction,
    CompressedInteractionNetwork,
    FeatureGate,
    GatheredInteractionArch,
    MultiHeadBilinearFusion,
)


@pytest.mark.parametrize("num_sparse_features", [0, 1, 26])
def test_gathered_interaction_is_torchrecs_bit_for_bit(num_sparse_features: int) -> None:
    """The same output and input gradients as TorchRec's InteractionArch, exactly."""
    dense = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    sparse = torch.randn(32, num_sparse_features, 8, generator=torch.Generator().manual_seed(1))
    upstream = None
    results = []
    for arch in (InteractionArch(num_sparse_features), GatheredInteractionArch(num_sparse_features)):
        inputs = (dense.clone().requires_grad_(), sparse.clone().requires_grad_())
        out = arch(*inputs)
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)) if upstream is None else upstream
        out.backward(upstream)
        results.append((out, *(x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs)))
        assert not arch.state_dict()  # no persistent buffers: checkpoints keep TorchRec's keys
    for theirs, ours in zip(*results):
        assert torch.equal(theirs, ours)


def test_cin_one_layer_by_hand() -> None:
    """X^1[h] = sum_ij W[h, i, j] (X^0[i] ∘ X^0[j]), then summed over the embedding axis."""
    cin = CompressedInteractionNetwork(num_fields=2, layer_sizes=[2])
    fields = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])  # one sample, x1 = (1, 2), x2 = (3, 4)
    with torch.no_grad():
        # map 0: 1 * x1∘x1 + 2 * x2∘x2 = (1, 4) + 2 * (9, 16) -> 55; map 1: x1∘x2 = (3, 8) -> 11
        cin.layers[0].weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 2.0], [0.0, 1.0, 0.0, 0.0]]))
    torch.testing.assert_close(cin(fields), torch.tensor([[55.0, 11.0]]))


def test_cin_layers_cross_previous_maps_with_the_fields() -> None:
    torch.manual_seed(0)
    fields = torch.randn(3, 4, 5)  # B, m, D
    cin = CompressedInteractionNetwork(num_fields=4, layer_sizes=[2, 3])
    x, expected = fields, []
    for layer in cin.layers:
        w = layer.weight.view(layer.out_features, x.shape[1], 4)  # (H_k, H_{k-1}, m)
        x = torch.stack(
            [sum(w[h, i, j] * x[:, i] * fields[:, j] for i in range(x.shape[1]) for j in range(4)) for h in range(len(w))],
            dim=1,
        )
        expected.append(x.sum(dim=2))
    out = cin(fields)
    assert out.shape == (3, 5)
    torch.testing.assert_close(out, torch.cat(expected, dim=1))

    interaction = CINInteraction(num_fields=5, embedding_dim=5, cin_layer_sizes=[2, 3], deep_layer_sizes=[8, 6])
    assert interaction(torch.randn(3, 5), fields).shape == (3, 2 + 3 + 6)
    with pytest.raises(ValueError, match="CIN layer_sizes"):
        CompressedInteractionNetwork(4, [])


def test_feature_gate_weights_each_element_by_its_context() -> None:
    torch.manual_seed(0)
    fields = torch.randn(4, 3, 2)
    shared = FeatureGate(num_fields=3, embedding_dim=2, context_fields=[], hidden_sizes=[8])
    gated = shared(fields)
    gate = gated / fields.flatten(1)
    assert gated.shape == (4, 6) and ((gate > 0) & (gate < 2)).all()
    torch.testing.assert_close(gate, gate[:1].expand(4, -1))  # no context: one gate for every sample

    by_field_1 = FeatureGate(num_fields=3, embedding_dim=2, context_fields=[1], hidden_sizes=[8])
    other = fields.clone()
    other[:, 2] += 1.0  # not the context: the gate stays
    torch.testing.assert_close(by_field_1(other) / other.flatten(1), by_field_1(fields) / fields.flatten(1))
    other[:, 1] += 1.0  # the context: the gate moves
    assert not torch.allclose(by_field_1(other) / other.flatten(1), by_field_1(fields) / fields.flatten(1))

    with torch.no_grad():
        last = by_field_1.gate._mlp[-1]._linear
        last.weight.zero_()
        last.bias.fill_(1.5)
    torch.testing.assert_close(by_field_1(fields), fields.flatten(1) * 2 * torch.sigmoid(torch.tensor(1.5)))
    with pytest.raises(ValueError, match="out of range"):
        FeatureGate(3, 2, [3], [8])


def test_multi_head_bilinear_fusion_by_hand() -> None:
    torch.manual_seed(0)
    fusion = MultiHeadBilinearFusion(x_dim=4, y_dim=6, num_heads=2)
    x, y = torch.randn(5, 4), torch.randn(5, 6)
    out = fusion(torch.cat([x, y], dim=1))
    w, b = fusion.linear.weight[0], fusion.linear.bias
    expected = b + x @ w[:4] + y @ w[4:]
    for h in range(2):  # head h: x[:, 2h:2h+2]^T W_h y[:, 3h:3h+3]
        expected = expected + ((x[:, 2 * h : 2 * h + 2] @ fusion.bilinear[h]) * y[:, 3 * h : 3 * h + 3]).sum(dim=1)
    assert out.shape == (5, 1)
    torch.testing.assert_close(out[:, 0], expected)
    with pytest.raises(ValueError, match="divide both stream widths"):
        MultiHeadBilinearFusion(4, 6, num_heads=4)


def test_finalmlp_gates_on_named_features_and_fuses_its_streams() -> None:
    dm = tiny_synthetic()
    model = _model("finalmlp", dm, stream1_layer_sizes=[16, 8], stream2_layer_sizes=[12],
                   stream1_gate_features=["cat_2"], num_heads=4)  # fmt: skip
    assert model.inter_arch.gate1.context_fields == [3]  # field 0 is the dense projection
    assert model.inter_arch.gate2.context_fields == []
    fusion = model.over_arch
    assert (fusion.x_dim, fusion.num_heads, tuple(fusion.bilinear.shape)) == (8, 4, (4, 2, 3))
    batch = dm.source("train").batch(0, 16)
    assert model(batch.dense_features, batch.sparse_features).shape == (16,)
    with pytest.raises(ValueError, match="not sparse features"):
        _model("finalmlp", dm, stream2_gate_features=["user_id"])


def test_dcn_mixture_of_low_rank_experts() -> None:
    from torchrec.modules.crossnet import LowRankMixtureCrossNet

    dm = tiny_synthetic()
    model = _model("dcn", dm, cross_version="mixture", num_experts=3, low_rank=4)
    cross = model.inter_arch.cross
    assert isinstance(cross, LowRankMixtureCrossNet) and cross._num_experts == 3 and cross._low_rank == 4
    batch = dm.source("train").batch(0, 16)
    model.loss_fn(model(batch.dense_features, batch.sparse_features), batch.labels).mean().backward()
    assert all(g.weight.grad is not None for g in cross.gates)  # the per-sample gate learns
    with pytest.raises(ValueError, match="num_experts"):
        _model("dcn", dm, cross_version="mixture", num_experts=0)


def test_xdeepfm_logit_is_linear_part_plus_cin_and_deep() -> None:
    dm = tiny_synthetic()
    model = _model("xdeepfm", dm, cin_layer_sizes=[4, 3], deep_layer_sizes=[8])
    assert model.over_arch.in_features == 4 + 3 + 8 and model.over_arch.bias is None
    batch = dm.source("train").batch(0, 16)
    dense, sparse = batch.dense_features, batch.sparse_features
    towers = model.over_arch(model.inter_arch(model.dense_arch(dense), model.embed(sparse))).squeeze(-1)
    torch.testing.assert_close(model(dense, sparse), towers + model.first_order_arch(dense, sparse))


# ----------------------------------------------------- first-order term: LR, FM, Wide & Deep, DeepFM
from lightning_hotcache.optim.rowwise import ROW_STATE_KEY  # noqa: E402
from models import FM, LR, DeepFM  # noqa: E402
from models.first_order import FIRST_ORDER_DIM  # noqa: E402

# Two samples; "item" and "item_hist" share a table, and item_hist is multi-hot (and empty once).
HAND_TABLES = [
    EmbeddingBagConfig(name="t_user", num_embeddings=5, embedding_dim=8, feature_names=["user"]),
    EmbeddingBagConfig(name="t_item", num_embeddings=7, embedding_dim=8, feature_names=["item", "item_hist"]),
]
HAND_FEATURES = {"user": ("t_user", [[1], [3]]), "item": ("t_item", [[2], [6]]), "item_hist": ("t_item", [[2, 5], []])}


def _hand_batch() -> tuple[torch.Tensor, KeyedJaggedTensor]:
    torch.manual_seed(1)
    bags = [bag for _, samples in HAND_FEATURES.values() for bag in samples]
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=list(HAND_FEATURES),
        values=torch.tensor([i for bag in bags for i in bag]),
        lengths=torch.tensor([len(bag) for bag in bags]),
    )
    return torch.randn(2, 3), sparse


def _randomize(model: CTRModel) -> None:
    """Random values everywhere, the first-order tables included (they start at zero)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))


def _pooled_by_hand(weights: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each feature's SUM-pooled rows of its table (``weights``: table -> weight), (B, width) each."""
    return [
        torch.stack([weights[table][ids].sum(dim=0) for ids in samples]) for table, samples in HAND_FEATURES.values()
    ]


def _first_order_by_hand(model: CTRModel, dense: torch.Tensor) -> torch.Tensor:
    """w0 + <w_dense, x> + the per-id weights (the mean of each first-order row), summed over features."""
    arch = model.first_order_arch
    bags = arch.embedding_bag_collection.embedding_bags
    weights = {t: bags[f"{t}_linear"].weight.mean(dim=1) for t in ("t_user", "t_item")}
    return arch.dense.bias + dense @ arch.dense.weight[0] + sum(_pooled_by_hand(weights))


def _pairwise_dots(fields: torch.Tensor) -> torch.Tensor:
    """sum_{i<j} <f_i, f_j> over fields (B, m, D), term by term."""
    m = fields.shape[1]
    return sum((fields[:, i] * fields[:, j]).sum(dim=1) for i in range(m) for j in range(i + 1, m))


def _embeddings_by_hand(model: CTRModel) -> torch.Tensor:
    bags = model.sparse_arch.embedding_bag_collection.embedding_bags
    return torch.stack(_pooled_by_hand({t: bags[t].weight for t in ("t_user", "t_item")}), dim=1)


def test_lr_is_logistic_regression_on_the_picked_weights() -> None:
    model = LR(HAND_TABLES, 3)
    _randomize(model)
    dense, sparse = _hand_batch()
    assert not hasattr(model, "sparse_arch"), "LR looks up no dim-D tables"
    assert {tuple(p.shape) for p in model.embedding_parameters()} == {(5, FIRST_ORDER_DIM), (7, FIRST_ORDER_DIM)}
    arch, bags = model.first_order_arch, model.first_order_arch.embedding_bag_collection.embedding_bags
    user, item = bags["t_user_linear"].weight.mean(dim=1), bags["t_item_linear"].weight.mean(dim=1)
    sample_0 = user[1] + item[2] + item[2] + item[5] + dense[0] @ arch.dense.weight[0] + arch.dense.bias[0]
    sample_1 = user[3] + item[6] + dense[1] @ arch.dense.weight[0] + arch.dense.bias[0]
    torch.testing.assert_close(model(dense, sparse), torch.stack([sample_0, sample_1]))
    torch.testing.assert_close(model(dense, sparse), _first_order_by_hand(model, dense))


def test_fm_is_first_order_plus_every_pair_of_fields() -> None:
    model = FM(HAND_TABLES, 3)
    _randomize(model)
    dense, sparse = _hand_batch()
    # Rendle's real-valued inputs: field x_j * v_j per dense feature, beside the 3 sparse fields.
    fields = torch.cat([dense.unsqueeze(-1) * model.dense_arch.factors, _embeddings_by_hand(model)], dim=1)
    assert fields.shape == (2, 3 + 3, 8)
    expected = _first_order_by_hand(model, dense) + _pairwise_dots(fields)
    torch.testing.assert_close(model(dense, sparse), expected)


def test_deepfm_logit_is_first_order_plus_fm_and_deep() -> None:
    model = DeepFM(HAND_TABLES, 3, dense_arch_layer_sizes=[4], deep_layer_sizes=[6])
    _randomize(model)
    dense, sparse = _hand_batch()
    fields = torch.cat([model.dense_arch(dense).unsqueeze(1), _embeddings_by_hand(model)], dim=1)
    deep = model.inter_arch.deep([fields])
    # The FM tower is the fields' pairwise dot products (not TorchRec's FactorizationMachine,
    # which multiplies every two scalars of the flattened fields).
    towers = torch.cat([deep, _pairwise_dots(fields).unsqueeze(1)], dim=1) @ model.over_arch.weight[0]
    assert model.over_arch.bias is None  # the bias is the first-order term's
    torch.testing.assert_close(model(dense, sparse), _first_order_by_hand(model, dense) + towers)


def test_wide_and_deep_logit_is_wide_plus_deep() -> None:
    dm = tiny_synthetic()
    model = _model("wide_deep", dm, deep_layer_sizes=[8, 4])
    _randomize(model)
    batch = dm.source("train").batch(0, 16)
    dense, sparse = batch.dense_features, batch.sparse_features
    deep = model.over_arch(model.inter_arch.deep.dense_module(torch.cat([model.embed(sparse).flatten(1), dense], 1)))
    torch.testing.assert_close(model(dense, sparse), model.first_order_arch(dense, sparse) + deep.squeeze(-1))


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("name", ["lr", "wide_deep"])
def test_first_order_rows_learn_by_the_row_wise_rule(name: str, optimizer: str) -> None:
    dm = tiny_synthetic(num_train_samples=256)
    model = _model(name, dm, embedding_optimizer={"name": optimizer, "lr": 0.1})
    batch = dm.source("train").batch(0, 256)
    model.loss_fn(model(batch.dense_features, batch.sparse_features), batch.labels).mean().backward()
    first_order = list(model.first_order_arch.embedding_bag_collection.parameters())
    assert all(p.grad is not None and p.grad.is_sparse for p in first_order)
    assert all(id(p) not in {id(d) for d in model.dense_parameters()} for p in first_order)
    model.zero_grad()

    key_format = "first_order_arch.embedding_bag_collection.embedding_bags.{}_linear.weight"
    after = _train_one_step_and_check_moved_rows(model, dm, key_format)
    for config in dm.tables:
        key = key_format.format(config.name)
        # Zero at first, the same gradient in every column: a row stays one weight.
        assert torch.equal(after[key], after[key][:, :1].expand(-1, FIRST_ORDER_DIM)), config.name


@pytest.mark.parametrize("name", ["lr", "fm"])
def test_first_order_checkpoint_resumes_exactly_and_loads(name: str, tmp_path) -> None:
    dm = tiny_synthetic(num_train_samples=1024)

    def fresh() -> CTRModel:
        pl.seed_everything(0)
        return _model(name, dm, embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.1})

    straight = fresh()
    cpu_trainer(max_epochs=2).fit(straight, dm)
    first = fresh()
    trainer = cpu_trainer(max_epochs=1)
    trainer.fit(first, dm)
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    row_state = torch.load(tmp_path / "epoch1.ckpt", weights_only=True)[ROW_STATE_KEY]
    assert "first_order_arch.embedding_bag_collection.t_cat_2_linear" in row_state
    resumed = fresh()
    cpu_trainer(max_epochs=2).fit(resumed, dm, ckpt_path=tmp_path / "epoch1.ckpt")
    torch.testing.assert_close(resumed.state_dict(), straight.state_dict(), rtol=1e-5, atol=1e-7)

    loaded = type(first).load_from_checkpoint(tmp_path / "epoch1.ckpt")
    torch.testing.assert_close(loaded.state_dict(), first.state_dict())


def test_first_order_keeps_the_table_checks() -> None:
    mixed = [HAND_TABLES[0], EmbeddingBagConfig(name="b", num_embeddings=10, embedding_dim=4, feature_names=["fb"])]
    with pytest.raises(ValueError, match="embedding_dim"):
        LR(mixed, 3)

    class NoLogit(LR):
        uses_first_order = False

    with pytest.raises(TypeError, match="neither uses_embeddings nor uses_first_order"):
        NoLogit(HAND_TABLES, 3)


def test_deferred_first_order_tables_are_declared_then_start_at_zero() -> None:
    from lightning_hotcache.embedding.table_init import materialize_tables

    model = FM(HAND_TABLES, 3, defer_table_init=True)
    assert all(p.is_meta for p in model.first_order_arch.embedding_bag_collection.parameters())
    assert materialize_tables(model, seed=model.table_init_seed)
    assert all(torch.count_nonzero(p) == 0 for p in model.first_order_arch.embedding_bag_collection.parameters())
    assert all(torch.count_nonzero(p) > 0 for p in model.sparse_arch.parameters())


@pytest.mark.parametrize("strategy", ["auto", "hotcache"])
@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("dense", r"dense_features are torch.float64, the model's dense layers torch.float32: give torch.float32"),
        ("labels", r"labels are torch.int64: give float labels"),
        ("ids", r"sparse_features ids are torch.float32: give integer ids"),
    ],
)
def test_a_batch_field_of_the_wrong_type_is_named_with_the_type_to_give(strategy, field, message) -> None:
    # Issue 69 item 9: float64 dense features or int64 labels failed inside torch; float ids
    # trained in silence under auto (cast by the lookup).
    from torch.utils.data import DataLoader
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    from lightning_hotcache import HotCacheStrategy

    dm = tiny_synthetic(batch_size=64, num_train_samples=256)
    dm.setup("fit")

    def broken(batch: Batch) -> Batch:
        kjt = batch.sparse_features
        if field == "ids":
            kjt = KeyedJaggedTensor(kjt.keys(), kjt.values().float(), lengths=kjt.lengths())
        dense = batch.dense_features.double() if field == "dense" else batch.dense_features
        labels = batch.labels.long() if field == "labels" else batch.labels
        return Batch(dense, kjt, labels)

    batches = [broken(b) for b in dm.train_dataloader()]
    model = create_model("dlrm", dm.tables, dm.num_dense_features)
    chosen = HotCacheStrategy(device_budget=1.0) if strategy == "hotcache" else "auto"
    with pytest.raises((TypeError, ValueError), match=message if strategy == "auto" or field != "ids" else r"ids|integer"):
        cpu_trainer(strategy=chosen, max_steps=1).fit(model, train_dataloaders=DataLoader(batches, batch_size=None))
