"""CTRModel: the LightningModule every zoo model is; subclasses only say how logits are made.

A CTR model here is torchrec's sparse arch (an EmbeddingBagCollection looked up with a
KeyedJaggedTensor) plus dense layers, and, in models with one (LR, FM, DeepFM, ...), a
first-order term with per-id weights in a collection of their own. The base class owns
what is the same for all of them: the embedding tables, the click loss and metrics, and
the split between the two kinds of parameters:

* embedding rows are trained by a row-wise rule (`RowWiseOptimizerConfig`) on sparse
  gradients, stepped right after the dense optimizer's backward pass; a placement strategy
  (e.g. ``hotcache``) that replaces the tables applies the same rule where the rows live;
* dense parameters use the optimizer from `configure_optimizers` (torch's fused Adam by
  default, or LightningCLI's ``--optimizer``).

The model code never decides where rows live: strategies do.
"""

from __future__ import annotations

import inspect
from abc import abstractmethod
from dataclasses import asdict
from typing import Any, Callable, ClassVar, Mapping, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import BinaryAUROC
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import SparseArch
from torchrec.modules.embedding_configs import PoolingType
from typing_extensions import Self, override

from lightning_hotcache._compat import writes_step_logs
from lightning_hotcache.checkpoint.files import check_not_sharded
from lightning_hotcache.distributed.collectives import broadcast_from_rank_zero
from lightning_hotcache.embedding import hot_cold_modules
from lightning_hotcache.embedding.torchrec_lookup import GradientRowsSink, PooledGradientsSink, pooled_in_one_node
from lightning_hotcache.distributed.global_batch import real_samples, share_mean
from lightning_hotcache._ops import step_graph as graph_ops
from lightning_hotcache._ops.graph_batches import TorchRecBatches
from lightning_hotcache._ops.guards import (
    NonFiniteLossAction,
    NonFiniteLossError,
    check_feature_dtypes,
    check_label_dtype,
    check_non_finite_loss_action,
    check_not_empty,
    finite_loss_or_skip,
)
from lightning_hotcache._ops.host_rows import release_helpers
from lightning_hotcache.strategies.precision import refuse_half_true_precision
from lightning_hotcache.optim.rowwise import ROW_STATE_KEY, RowWiseOptimizer, RowWiseOptimizerConfig, use_sparse_gradients
from lightning_hotcache.distributed.sparse_ddp import average_row_gradients, keep_out_of_ddp
from lightning_hotcache.optim.stacked_tables import move_stacked_tables, stack_tables
from lightning_hotcache.embedding.table_init import draw_seed, materialize_tables
from lightning_hotcache.strategies.hotcache import HotCacheStrategy
from lightning_hotcache.strategies.torchrec import refuse_sharded_tables
from models.first_order import FirstOrderArch

TableSpec = EmbeddingBagConfig | Mapping[str, Any]


def fused_adam_fits(parameters: Sequence[Tensor]) -> bool | None:
    """Whether torch's fused Adam can step ``parameters``: its step is one kernel for all of them
    (on a GPU, where a step's launches are host time, the multi-tensor default launches one per
    op of the rule), and on the CPU torch's default is a loop over the parameters, several
    times slower for the zoo's dense layers. ``None`` leaves torch's
    default where it cannot (another device, or parameters not floating point)."""
    fits = bool(parameters) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in parameters)
    return True if fits else None


def as_table_config(table: TableSpec) -> EmbeddingBagConfig:
    """An EmbeddingBagConfig from itself or from the plain dict kept in hyperparameters."""
    if isinstance(table, EmbeddingBagConfig):
        return table
    fields = dict(table)
    if isinstance(fields.get("pooling"), str):
        fields["pooling"] = PoolingType[fields["pooling"]]
    return EmbeddingBagConfig(**fields)


def table_to_dict(table: EmbeddingBagConfig) -> dict[str, Any]:
    """The fields that define a table, as plain values (checkpoints load with weights_only)."""
    return {
        "name": table.name,
        "num_embeddings": table.num_embeddings,
        "embedding_dim": table.embedding_dim,
        "feature_names": list(table.feature_names),
        "pooling": table.pooling.name,
    }


class _AssembledAfterInit(type):
    """Metaclass of CTRModel: builds the layers once the whole ``__init__`` chain has returned, so a
    subclass may set what its builders read after ``super().__init__()``, as usual in PyTorch."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        model = super().__call__(*args, **kwargs)
        model._assemble_after_init()
        return model

    @property
    def __signature__(cls) -> inspect.Signature:
        # Else inspect.signature(model class) would be this __call__'s (*args, **kwargs).
        init = inspect.signature(cls.__init__)
        return init.replace(parameters=list(init.parameters.values())[1:], return_annotation=inspect.Signature.empty)


# Precisions whose training step a CUDA graph records: autocast's casts are recorded with the
# step (each capture and replay is one autocast region of Lightning's, its cast cache emptied
# between steps).
GRAPHED_PRECISIONS = ("32-true", "bf16-mixed")


class CTRModel(pl.LightningModule, metaclass=_AssembledAfterInit):
    """Base LightningModule for click-through-rate models on torchrec batches.

    Args:
        tables: one ``EmbeddingBagConfig`` per embedding table (the datamodule's ``.tables``);
            all tables share one ``embedding_dim``.
        num_dense_features: width of the dense input (the datamodule's ``.num_dense_features``).
        embedding_optimizer: the row-wise rule for embedding rows.
        dense_lr: learning rate of the default dense optimizer (Adam).
        dense_weight_decay: L2 penalty of the default dense optimizer (Adam's ``weight_decay``,
            the gradient of ``dense_weight_decay / 2 * ||w||^2`` over every dense parameter);
            the embedding rows are not affected. 0 turns it off.
        embedding_l2: weight of an L2 penalty on what each training batch reads from the
            tables (DeepCTR's ``l2_reg_embedding``, FuxiCTR's ``embedding_regularizer``, here
            on the batch's rows only): the training loss gets ``embedding_l2`` times the mean
            over samples of the squared norm of the sample's pooled embeddings (B, F, D) and
            per-id weights (see `logits_and_squared_norms`). Validation, test and predict are
            unaffected. 0 turns it off.
        defer_table_init: declare the tables on the meta device, with no memory, as TorchRec
            does for tables to be sharded. ``hotcache`` then writes each table's initial rows
            straight into its tiers (with ``host_storage=<dir>``, tables larger than RAM
            train); any other strategy gets the tables allocated and initialized in memory
            when fit starts. Rows come from each table's ``init_fn`` (see `initial_rows`).
        non_finite_loss: what a NaN/inf training loss does, before any row or weight learns
            from it: ``"raise"`` stops with an error naming the step and batch; ``"skip"``
            skips the batch (no backward, no optimizer step) with a warning, in one process
            only (refused at fit start with more: Lightning cannot skip a step on every rank).
        cuda_graph: on a CUDA device, record the training step (forward, backward, the row-wise
            update) in one CUDA graph once batches of one shape have come in a row, and replay
            it for every batch of those shapes (`lightning_hotcache._ops.step_graph`); other
            batches (an epoch's short last one, multi-hot batches of changing lengths) step
            eagerly. It applies under one process's own strategy (``auto`` on one GPU, or
            ``hotcache`` with its caches' directory in GPU memory), in float32 (TF32 matmuls
            too) or bf16-mixed, without gradient accumulation, with
            ``non_finite_loss="raise"``, and to this class's step (a subclass that overrides
            ``training_step``, ``training_loss`` or ``backward`` steps eagerly); the log line at fit start says which. The dense
            optimizer still steps after it, through Lightning's hooks (clipping, schedulers). Under
            the graph a non-finite loss is read a step late (or at the step's logging): the
            error then comes after that step's update and the next step have run, and before
            any checkpoint is written. ``False`` always steps eagerly.

    ``train/loss`` (the global batch's mean) is logged on each epoch's first step and on the
    steps whose logs Lightning writes to the loggers (every ``trainer.log_every_n_steps``;
    set it to 1 for every step): the loggers get what they got when it was logged every
    step, and the progress bar and ``trainer.callback_metrics`` hold the latest written
    step's loss. Each ``self.log`` call is host time in Lightning's step, which a GPU step
    bound by its host cannot spare.
    """

    # training_step checks its loss itself (see `non_finite_loss`): the hotcache strategy
    # then does not check it again.
    checks_non_finite_loss = True
    # The two terms whose sum is the logit (see `forward`); a subclass switches them:
    # the embedding tower (TorchRec's sparse arch over the dim-D tables, then the dense
    # arch, interaction and over arch of the builders below), and the first-order term
    # (`FirstOrderArch`: a weight per sparse id in tables of its own, plus a linear layer
    # on the dense features and the bias).
    uses_embeddings: ClassVar[bool] = True
    uses_first_order: ClassVar[bool] = False

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        num_dense_features: int,
        embedding_optimizer: RowWiseOptimizerConfig = RowWiseOptimizerConfig(),
        dense_lr: float = 1e-3,
        dense_weight_decay: float = 0.0,
        embedding_l2: float = 0.0,
        defer_table_init: bool = False,
        non_finite_loss: NonFiniteLossAction = "raise",
        cuda_graph: bool = True,
    ) -> None:
        super().__init__()
        check_non_finite_loss_action(non_finite_loss)
        table_configs = [as_table_config(t) for t in tables]
        if not table_configs:
            raise ValueError("A CTR model needs at least one embedding table; `tables` is empty.")
        dims = {t.embedding_dim for t in table_configs}
        if len(dims) != 1:
            raise ValueError(
                f"All tables must share one embedding_dim (the interaction layers need it); got {sorted(dims)} "
                f"across {[t.name for t in table_configs]}."
            )
        if num_dense_features < 1:
            raise ValueError(f"num_dense_features must be >= 1, got {num_dense_features}.")
        if not (self.uses_embeddings or self.uses_first_order):
            raise TypeError(
                f"{type(self).__name__} sets neither uses_embeddings nor uses_first_order: it has no logit."
            )
        if not dense_lr > 0:
            raise ValueError(f"dense_lr must be > 0, got {dense_lr}.")
        if not dense_weight_decay >= 0:
            raise ValueError(f"dense_weight_decay must be >= 0 (0 turns it off), got {dense_weight_decay}.")
        if not embedding_l2 >= 0:
            raise ValueError(f"embedding_l2 must be >= 0 (0 turns the penalty off), got {embedding_l2}.")
        if isinstance(embedding_optimizer, Mapping):
            embedding_optimizer = RowWiseOptimizerConfig(**embedding_optimizer)

        # Plain values only, so checkpoints load with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["tables", "embedding_optimizer"])
        self.hparams["tables"] = [table_to_dict(t) for t in table_configs]
        self.hparams["embedding_optimizer"] = asdict(embedding_optimizer)

        self.tables = table_configs
        self.num_dense_features = num_dense_features
        self.embedding_dim = dims.pop()
        self.embedding_optimizer_config = embedding_optimizer
        table_device = torch.device("meta") if defer_table_init else None
        # Drawn where eager tables draw their rows, so a seeded run gets the same tables under
        # every strategy, whenever and wherever they are materialized.
        self.table_init_seed = draw_seed() if defer_table_init else None
        self.num_sparse_features = sum(len(t.feature_names) for t in table_configs)
        if self.uses_embeddings:
            self.sparse_arch = SparseArch(EmbeddingBagCollection(tables=table_configs, device=table_device))
            use_sparse_gradients(self.sparse_arch)
        if self.uses_first_order:
            self.first_order_arch = FirstOrderArch(table_configs, num_dense_features, device=table_device)
        stack_tables(self)  # one tensor of rows per collection: one op a step for all its tables
        self._embedding_optimizer: RowWiseOptimizer | None = None
        # This fit's plain tables and whether DDP left them out, found once at its start (see
        # `on_fit_start`; None outside a fit): a walk over the modules each step is host time the step need not spend.
        self._fit_tables: list[Tensor] | None = None
        self._fit_tables_outside_ddp = False
        # This fit's graph of the training step (None: every step eager) and what its steps
        # share: each dense parameter's gradient tensor (the graph writes into the same ones
        # every step), whether the current step ran in it, and the last graphed step's
        # not-finite flag (read a step late) with its step and batch.
        self._step_graph: graph_ops.StepGraph[Batch] | None = None
        # The strategy's collections, which check each batch before the graph gets it (found once
        # a fit, not every step).
        self._graph_checks: list[Any] = []
        self._graph_grads: list[tuple[Tensor, Tensor]] = []
        self._graph_stepped = False
        self._graph_flag: graph_ops.FlagReadLater | None = None
        self._graph_flag_step: tuple[int, int] = (0, 0)
        self._said_eager: set[str] = set()  # the reasons a step ran eagerly, said once a fit

        # Per sample: training averages it over the global batch (`share_mean`).
        self.loss_fn = nn.BCEWithLogitsLoss(reduction="none")
        metrics = MetricCollection({"auc": BinaryAUROC(), "logloss": MeanMetric()})
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")

    def _assemble_after_init(self) -> None:
        self.assemble()
        # Recorded now: strategies later swap the tables for other module types at these paths.
        self._embedding_paths = [p for p, m in self.named_modules() if isinstance(m, EmbeddingBagCollection)]
        # Under plain DDP the model averages its tables' gradient rows itself (see sparse_ddp).
        keep_out_of_ddp(self, self.embedding_parameters())

    # ------------------------------------------------------------ architecture
    # A model is TorchRec's four blocks: sparse arch (here), dense arch, interaction and
    # over arch. `assemble()` runs once the model's whole __init__ chain has returned, so the
    # builders can read `self.hparams` (the constructor arguments of every class in the chain)
    # and any attribute a subclass set after super().__init__(); in turn, the dense arch,
    # interaction and over arch do not exist yet inside __init__. A user subclass overrides
    # one builder and keeps the rest.
    @abstractmethod
    def build_dense_arch(self) -> nn.Module:
        """Module mapping dense features (B, num_dense_features) to the interaction's dense input."""

    @abstractmethod
    def build_interaction(self) -> nn.Module:
        """Module mapping (dense arch output, pooled embeddings (B, F, D)) to (B, width)."""

    @abstractmethod
    def build_over_arch(self, in_features: int) -> nn.Module:
        """Module mapping the interaction output (B, in_features) to logits (B, 1)."""

    def assemble(self) -> None:
        """Build the dense arch, interaction and over arch from the builders (a model without
        the embedding tower has none)."""
        if not self.uses_embeddings:
            return
        self.dense_arch = self.build_dense_arch()
        self.inter_arch = self.build_interaction()
        # The over arch's input width follows from whatever interaction a subclass built.
        with torch.no_grad():
            probe = self.inter_arch(
                self.dense_arch(torch.zeros(2, self.num_dense_features)),
                torch.zeros(2, self.num_sparse_features, self.embedding_dim),
            )
        self.over_arch = self.build_over_arch(probe.shape[1])

    def embed(self, sparse_features: KeyedJaggedTensor) -> Tensor:
        """Pooled embeddings, (B, F, D) in table/feature order."""
        check_not_empty(sparse_features)
        tables = self.sparse_arch.embedding_bag_collection
        pooled = pooled_in_one_node(tables, sparse_features, self._gradient_rows_to(), self._pooled_gradients_to())
        if pooled is None:  # a strategy's tables (hotcache, torchrec), or a batch of other keys
            keyed = tables(sparse_features)
            names = self.sparse_arch.sparse_feature_names
            # TorchRec's SparseArch splits the output by feature and concatenates it again in its
            # own order, a copy and two ops per feature forward and back on the host; the tables'
            # output is in that order already but where sharding reordered it.
            pooled = keyed.values() if keyed.keys() == names else torch.cat([keyed[name] for name in names], dim=1)
        return pooled.reshape(-1, self.num_sparse_features, self.embedding_dim)

    def _gradient_rows_to(self) -> GradientRowsSink | None:
        """Where a lookup hands its tables' gradient rows over as one piece: the row-wise
        optimizer, in a fit that steps the plain tables (see `RowWiseOptimizer.add_row_gradients`:
        no ``.grad`` per table, each host time a step on a GPU's host). Outside a fit
        each table's sparse gradient goes to its ``.grad``, as TorchRec's forward gives it."""
        if self._fit_tables and torch.is_grad_enabled():
            return self.embedding_optimizer.add_row_gradients
        return None

    def _pooled_gradients_to(self) -> PooledGradientsSink | None:
        """Where a lookup the Triton TBE pools hands its pooled gradient over, for the row-wise
        optimizer to step in Triton's kernel (`RowWiseOptimizer.add_pooled_gradients`)."""
        return self.embedding_optimizer.add_pooled_gradients if self._gradient_rows_to() is not None else None

    @override
    def forward(self, dense_features: Tensor, sparse_features: KeyedJaggedTensor) -> Tensor:
        """Click logits of shape (B,): the embedding tower's plus the first-order term, each
        where the model has it."""
        return self.logits_and_squared_norms(dense_features, sparse_features)[0]

    def logits_and_squared_norms(
        self, dense_features: Tensor, sparse_features: KeyedJaggedTensor
    ) -> tuple[Tensor, Tensor]:
        """Click logits (B,) and, per sample, the squared L2 norm of what it read from the
        tables (B,): its pooled embeddings and its pooled per-id weights (`FirstOrderArch.squared_norms`).

        Pooled, not row by row: a strategy's tables return the pooled bags, so the penalty's
        gradient reaches the rows through the same backward as the loss's, under every
        strategy. For a single-id feature it is the row's squared norm; for a multi-id one
        (SUM pooling) that of the bag the model reads, the sum of its rows.
        """
        check_feature_dtypes(dense_features, sparse_features, self._dense_dtype)
        if self.uses_embeddings:
            pooled = self.embed(sparse_features)
            logits = self.over_arch(self.inter_arch(self.dense_arch(dense_features), pooled)).squeeze(-1)
            squared_norms = pooled.square().sum(dim=(1, 2))
            if not self.uses_first_order:
                return logits, squared_norms
        weights = self.first_order_arch.lookup(sparse_features, self._gradient_rows_to(), self._pooled_gradients_to())
        first_order = self.first_order_arch.logits(dense_features, weights)
        first_order_norms = self.first_order_arch.squared_norms(weights)
        if not self.uses_embeddings:
            return first_order, first_order_norms
        return logits + first_order, squared_norms + first_order_norms

    @property
    def _dense_dtype(self) -> torch.dtype:
        """The float type the dense features meet: the first dense layer's with weights (the
        dense arch's, or the over arch's where the dense arch is an identity, or the first-order
        term's dense weight where the model has no embedding tower)."""
        layers = [self.dense_arch, self.over_arch] if self.uses_embeddings else [self.first_order_arch.dense]
        for layer in layers:
            for parameter in layer.parameters():
                return parameter.dtype
        return torch.get_default_dtype()

    @override
    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Self:
        # Moves and casts take each collection's stack of tables whole: `nn.Module._apply` would
        # move every table apart, into memory of its own.
        if recurse:
            move_stacked_tables(self, fn)
        return super()._apply(fn, recurse)

    # ----------------------------------------------------------------- training
    def training_loss(self, batch: Batch) -> Tensor:
        """The loss a training step backpropagates: the click loss (plus the ``embedding_l2``
        penalty) as the mean over the global batch once the processes' gradients are averaged,
        also at an uneven epoch end (see `share_mean`)."""
        check_label_dtype(batch.labels)
        logits, squared_norms = self.logits_and_squared_norms(batch.dense_features, batch.sparse_features)
        per_sample = self.loss_fn(logits, batch.labels)
        if self.hparams.embedding_l2:
            per_sample = per_sample + self.hparams.embedding_l2 * squared_norms
        return share_mean(per_sample, batch)

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor | None:
        self._graph_stepped = False
        if self._step_graph is not None:
            for module in self._graph_checks:  # the graph's forward reads a static copy, unchecked
                if module.reads(batch.sparse_features):
                    module.check(batch.sparse_features)
            graphed = self._step_graph.run(batch)
            if graphed is not None:
                return self._after_graphed_step(batch, batch_idx, *graphed)
            self._say_why_this_step_is_eager()
        loss = self.training_loss(batch)
        logged = finite_loss_or_skip(loss, self.trainer, batch_idx, self.hparams.non_finite_loss)
        if logged is None:
            return None
        # The mean over ranks of their `share_mean`s, the global batch's mean loss (a rank's own
        # would be N/n times it on an uneven last share, and 0 on a padding one), on the host
        # already: no sync_dist collective, and no device read for the progress bar.
        if batch_idx == 0 or writes_step_logs(self.trainer):
            self.log("train/loss", logged, prog_bar=True, batch_size=batch.labels.shape[0])
        return loss

    # ------------------------------------------------------ the step's CUDA graph
    def _why_the_step_is_not_graphed(self) -> str | None:
        """Why this fit's training step cannot be recorded in a graph (None where it can)."""
        trainer = self.trainer
        if not self.hparams.cuda_graph:
            return "cuda_graph=False"
        if isinstance(trainer.strategy, HotCacheStrategy) and trainer.world_size == 1:
            refusal = trainer.strategy.why_the_step_is_not_graphed()
            if refusal is not None:
                return refusal
        elif not isinstance(trainer.strategy, SingleDeviceStrategy) or trainer.world_size > 1:
            return (
                f"the {type(trainer.strategy).__name__} strategy places it (a graph is recorded under one process's "
                "own strategy, `auto` or `hotcache` on one GPU)"
            )
        if not self.automatic_optimization:
            return "manual optimization"
        if self.hparams.non_finite_loss == "skip":
            return "non_finite_loss='skip' needs each step's loss on the host before its backward"
        if trainer.accumulate_grad_batches != 1:
            return f"accumulate_grad_batches={trainer.accumulate_grad_batches}"
        if trainer.precision not in GRAPHED_PRECISIONS:
            # 16-mixed scales the loss and skips steps whose gradients overflow, which the host decides.
            return f"precision={trainer.precision!r} (the graph records {' and '.join(GRAPHED_PRECISIONS)} steps)"
        for hook in ("training_step", "training_loss", "backward"):
            if getattr(type(self), hook) is not getattr(CTRModel, hook):
                return f"{type(self).__name__}.{hook} overrides CTRModel's, which the graph records"
        return None

    @property
    def step_graph(self) -> graph_ops.StepGraph[Batch] | None:
        """This fit's graph of the training step (its counts: captures, replays, eager steps);
        None outside a fit or where every step runs eagerly."""
        return self._step_graph

    def _new_step_graph(self) -> graph_ops.StepGraph[Batch] | None:
        """This fit's graph of the training step, or None (said in a log line where the device
        runs graphs)."""
        graphs = graph_ops.graphs_for(self.device)
        if graphs is None:
            return None
        name, reason = type(self).__name__, self._why_the_step_is_not_graphed()
        if reason is not None:
            rank_zero_info(f"{name}: training steps run eagerly on {self.device}: {reason}.")
            return None
        self._graph_grads = [(p, torch.zeros_like(p)) for p in self.dense_parameters()]
        self._graph_flag = graph_ops.FlagReadLater(self.device)
        rank_zero_info(
            f"{name}: the training step (forward, backward, row-wise update) is recorded in one CUDA graph once "
            f"{graph_ops.WARMUP_STEPS} batches of one shape come in a row, and replayed for each batch of those "
            "shapes; other batches step eagerly (cuda_graph=False: always)."
        )
        return graph_ops.StepGraph(self._graphed_step, TorchRecBatches(), graphs, touched=self._graphed_step_writes)

    def _graphed_step(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """What the graph records: the forward and loss, the backward into the dense parameters'
        gradient tensors (the same ones every step, zeroed first: a graph writes where it was
        recorded writing), and the row-wise update. Returns the loss and whether it is not finite."""
        for parameter, grad in self._graph_grads:
            parameter.grad = grad
        torch._foreach_zero_([grad for _, grad in self._graph_grads])
        try:
            loss = self.training_loss(batch)
            loss.backward()
            self._step_rows()
        except BaseException:
            if self._fit_tables:  # the gradient rows a refused capture handed over (hotcache's collections step their own)
                self.embedding_optimizer.zero_grad()
            raise
        return loss.detach(), torch.isfinite(loss).logical_not()

    def _graphed_step_writes(self) -> list[Tensor]:
        rows = self.embedding_optimizer.state_tensors() if self._fit_tables else []  # none under hotcache: its collections step their rows
        return [*self.parameters(), *(grad for _, grad in self._graph_grads), *rows, *self._hot_cold_tensors()]

    def _hot_cold_tensors(self) -> list[Tensor]:
        """What a step writes in the hotcache strategy's collections (rows, host rows, directories)."""
        return [t for module in hot_cold_modules(self).values() for t in module.step_tensors()]

    def _after_graphed_step(self, batch: Batch, batch_idx: int, loss: Tensor, not_finite: Tensor) -> Tensor:
        """Lightning's part of a step the graph ran: the previous graphed step's loss checked,
        the loss logged where Lightning writes logs (its only read of the device then)."""
        self._graph_stepped = True
        self._check_graphed_losses()  # the previous graphed step's
        self._graph_flag.record(not_finite)
        self._graph_flag_step = (self.global_step, batch_idx)
        if batch_idx == 0 or writes_step_logs(self.trainer):
            value = float(loss)
            self._check_graphed_losses()
            self.log("train/loss", value, prog_bar=True, batch_size=batch.labels.shape[0])
        return loss

    def _say_why_this_step_is_eager(self) -> None:
        """One log line a fit per reason a step ran eagerly after the warm-up."""
        graph, name = self._step_graph, type(self).__name__
        if graph.eager_reason is not None and "refused" not in self._said_eager:
            rank_zero_warn(f"{name}: the training step could not be recorded in a CUDA graph ({graph.eager_reason}); it steps eagerly from now on.")
            self._said_eager.add("refused")
        elif graph.eager_reason is None and graph.captures and "shapes" not in self._said_eager:
            rank_zero_info(
                f"{name}: a batch of other shapes than the CUDA graph's (an epoch's short last batch, or ids of other "
                f"lengths) steps eagerly; {graph.warmup} batches of a new shape in a row are recorded in a new graph."
            )
            self._said_eager.add("shapes")

    def _check_graphed_losses(self) -> None:
        """Raise where the last graphed step's loss was not finite (waits for that step)."""
        if self._graph_flag is None or not self._graph_flag.read():
            return
        step, batch_idx = self._graph_flag_step
        raise NonFiniteLossError(
            f"The training loss was NaN or infinite at step {step} (batch {batch_idx} of its epoch). The step's CUDA "
            "graph reads its loss a step late (or at the step's logging), so that step's update and the next step "
            "have run: the weights in memory learned from it, and no checkpoint was written after it. Look for "
            "NaN/inf in that batch's dense features and resume from the last checkpoint (cuda_graph=False checks "
            "each loss before its backward)."
        )

    @override
    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        if self._graph_stepped:
            # The graph ran this step's backward; the dense optimizer reads its gradients.
            for parameter, grad in self._graph_grads:
                parameter.grad = grad
            return
        super().backward(loss, *args, **kwargs)

    @override
    def on_train_epoch_end(self) -> None:
        # Subclasses overriding this hook must call super().
        self._check_graphed_losses()

    def _evaluate(self, batch: Batch, metrics: MetricCollection) -> None:
        # Every sample's forward, padding too (it is a collective step under hotcache); the
        # metrics see the data only, so they do not depend on the number of processes.
        real = real_samples(batch)
        check_label_dtype(batch.labels)
        logits = self(batch.dense_features, batch.sparse_features)[:real]
        labels = batch.labels[:real]
        per_sample = self.loss_fn(logits, labels)
        metrics["auc"].update(torch.sigmoid(logits), labels.long())
        metrics["logloss"].update(per_sample)
        self.log_dict(metrics, prog_bar=True, batch_size=real)

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, self.val_metrics)

    @override
    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, self.test_metrics)

    @override
    def predict_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return torch.sigmoid(self(batch.dense_features, batch.sparse_features))[: real_samples(batch)]

    def _log_reference_metrics(self, stage: str) -> None:
        # Datamodules with a planted truth (the synthetic one) know the Bayes-optimal figures.
        datamodule = getattr(self.trainer, "datamodule", None)
        reference = getattr(datamodule, "reference_metrics", None)
        if reference is None or self.trainer.sanity_checking:
            return
        # Every rank scores the whole split, so the figures agree: their max across ranks is
        # each rank's value, exactly. Without a sync Lightning warns at every validation of a
        # distributed strategy (hotcache's, even in one process) that an unsynced epoch value
        # may differ between ranks.
        for name, value in reference(stage).items():
            self.log(f"{stage}/{name}", float(value), sync_dist=True, reduce_fx="max")

    # Metric states reset by an earlier `trainer.validate` under inference mode are inference
    # tensors, which a later fit's validation (run under no_grad) cannot update in place.
    @override
    def on_validation_epoch_start(self) -> None:
        self.val_metrics.reset()

    @override
    def on_test_epoch_start(self) -> None:
        self.test_metrics.reset()

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_reference_metrics("val")

    @override
    def on_test_epoch_end(self) -> None:
        self._log_reference_metrics("test")

    # --------------------------------------------------------------- optimizers
    def embedding_parameters(self) -> list[Tensor]:
        """Weights of the plain EmbeddingBagCollections still in the model (none once a
        strategy has replaced them with its own tables)."""
        return [
            p for module in self.modules() if isinstance(module, EmbeddingBagCollection) for p in module.parameters()
        ]

    def dense_parameters(self) -> list[Tensor]:
        """Everything but the embedding tables, wherever a strategy has put the tables (by
        module path: sharded or cached tables are other objects under the same names)."""
        prefixes = tuple(f"{path}." for path in self._embedding_paths)
        return [p for name, p in self.named_parameters() if not name.startswith(prefixes) and p.requires_grad]

    @property
    def embedding_optimizer(self) -> RowWiseOptimizer:
        if self._embedding_optimizer is None:
            self._embedding_optimizer = RowWiseOptimizer(self.embedding_parameters(), self.embedding_optimizer_config)
        return self._embedding_optimizer

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        parameters = self.dense_parameters()
        return torch.optim.Adam(
            parameters, lr=self.hparams.dense_lr, weight_decay=self.hparams.dense_weight_decay, fused=fused_adam_fits(parameters)
        )

    def _tables_outside_ddp(self) -> bool:
        """Whether the tables are replicated on every rank but left out of DDP (see sparse_ddp)."""
        return isinstance(self.trainer.strategy.model, DistributedDataParallel) and self.trainer.world_size > 1

    @override
    def setup(self, stage: str) -> None:
        refuse_half_true_precision(self.trainer, f"{type(self).__name__} (a zoo model)")
        if stage == "fit":
            refuse_sharded_tables(self, f"{type(self).__name__} (a zoo model)")
        # Refused now, not at the first NaN hours in: Lightning does not let a training_step
        # return None with several processes, and a zero loss in its place would still move
        # Adam's moments (dense and lazy row state), so it would not be a skip.
        if stage == "fit" and self.hparams.non_finite_loss == "skip" and self.trainer.world_size > 1:
            raise ValueError(
                f"non_finite_loss='skip' needs one process; this fit has {self.trainer.world_size}. Lightning cannot "
                "skip a training step on every rank. Use non_finite_loss='raise' (the default: the run stops at the "
                "first non-finite loss, naming the rank, step and batch, before anything learns from it)."
            )

    @override
    def on_fit_start(self) -> None:
        # The strategy has placed the model by now (its tables replaced, or wrapped in DDP), and
        # they stay as they are for the fit. DDP gave every rank rank 0's dense weights; the
        # tables it leaves out get them here. Subclasses overriding this hook must call super().
        self._fit_tables, self._fit_tables_outside_ddp = self.embedding_parameters(), self._tables_outside_ddp()
        if self._fit_tables_outside_ddp:
            broadcast_from_rank_zero(self._fit_tables)
        if self._embedding_optimizer is not None:
            # A fit stopped between a backward and its step left that batch's gradients: not this fit's.
            self._embedding_optimizer.zero_grad()
        self._graph_flag, self._said_eager = None, set()
        self._graph_checks = list(hot_cold_modules(self).values())
        self._step_graph = self._new_step_graph()

    @override
    def on_fit_end(self) -> None:
        # A later fit may place the tables otherwise (another strategy). Subclasses overriding
        # this hook must call super().
        self._fit_tables = None
        self._step_graph, self._graph_grads, self._graph_flag = None, [], None  # the graph's memory goes with it
        self._graph_checks = []
        release_helpers()  # the row-wise step's copy threads (many-core hosts): none outlives the fit

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Runs after backward (and after gradient accumulation), before the dense step: the
        # same point TorchRec's fused optimizers update rows. Subclasses overriding this hook
        # must call super().
        if self._fit_tables is None:
            raise RuntimeError(
                f"{type(self).__name__}.on_fit_start did not reach CTRModel.on_fit_start, which finds the tables the "
                "row-wise optimizer steps: a subclass overriding on_fit_start must call super().on_fit_start()."
            )
        if not self._graph_stepped:  # else the graph stepped the rows
            self._step_rows()

    def _step_rows(self) -> None:
        """The row-wise update of the plain tables from this step's gradient rows."""
        if not self._fit_tables:
            return
        # DDP left the tables out (keep_out_of_ddp): their gradient rows are averaged in the step.
        self.embedding_optimizer.step(reduce_rows=average_row_gradients if self._fit_tables_outside_ddp else None)

    def _plain_table_weights(self) -> dict[str, Tensor]:
        """``"<module path>.<table>"`` -> weight of every plain table (the row-state key format)."""
        return {
            f"{path}.{name}": bag.weight
            for path, module in self.named_modules()
            if isinstance(module, EmbeddingBagCollection)
            for name, bag in module.embedding_bags.items()
        }

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._check_graphed_losses()  # no checkpoint after a graphed step whose loss was not finite
        weights = self._plain_table_weights()
        if weights:
            state = self.embedding_optimizer.state
            checkpoint[ROW_STATE_KEY] = {key: dict(state[w]) for key, w in weights.items() if state.get(w)}

    @override
    def configure_model(self) -> None:
        # Deferred tables are materialized here (before the strategy wraps the model; also
        # called by load_from_checkpoint, before the state is loaded), unless the strategy
        # places rows itself.
        try:
            strategy = self.trainer.strategy
        except RuntimeError:  # not attached: load_from_checkpoint calls this hook too
            strategy = None
        if not getattr(strategy, "initializes_deferred_tables", False) and materialize_tables(self, seed=self.table_init_seed):
            self._embedding_optimizer = None  # it held the meta parameters

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_not_sharded(checkpoint)
        saved = checkpoint.get(ROW_STATE_KEY, {})
        for key, weight in self._plain_table_weights().items():
            if key in saved:
                self.embedding_optimizer.state[weight] = {k: v.clone() for k, v in saved[key].items()}
