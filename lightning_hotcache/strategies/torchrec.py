"""TorchRecStrategy: the baseline, TorchRec's own sharding (DistributedModelParallel) under Lightning.

Lightning launches the processes and the process group as for DDP; instead of wrapping the
model in DDP, the strategy shards its EmbeddingBagCollections with a plan from TorchRec's
EmbeddingShardingPlanner and lets DistributedModelParallel wrap the dense rest in DDP.
Embedding rows are trained by TorchRec's fused in-backward optimizer set to the model's
row-wise rule (``model.embedding_optimizer_config``), so the zoo models learn the same
thing as under ``auto`` and ``hotcache``. Process-group set-up and wrapping stay here, out of
the model (unlike torchrecipes' TorchrecStrategy, which put them in the model).

Checkpoints gather sharded tables into plain tensors under the plain keys, and the fused
optimizer's row-wise state (row-wise Adagrad's momentum, kept inside TorchRec's kernels, out of
Lightning's optimizer states) into the row-state format every strategy reads
(`ROW_STATE_KEY`), so a run resumes exactly under any strategy.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Mapping, Sequence

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torchrec import EmbeddingBagCollection
from typing_extensions import override

from lightning_hotcache.distributed import collectives
from lightning_hotcache.strategies.accumulation import refuse_gradient_accumulation, refuse_gradient_accumulation_now
from lightning_hotcache.distributed.even_batches import check_even_batches
from lightning_hotcache.strategies.like_auto import LikeAutoInOneProcess, global_rngs_restored
from lightning_hotcache.planner.plan import _quiet_torchrec_planner
from lightning_hotcache.strategies.precision import refuse_half_true_precision
from lightning_hotcache.optim.rowwise import ROW_STATE_KEY, RowWiseOptimizerConfig

log = logging.getLogger(__name__)

# DDPStrategy settings this strategy cannot honour, with the one value it takes (see TorchRecStrategy).
_UNSUPPORTED_SETTINGS: dict[str, Any] = {
    "ddp_comm_hook": None,
    "ddp_comm_state": None,
    "ddp_comm_wrapper": None,
    "model_averaging_period": None,
    "start_method": "popen",
}
# DistributedDataParallel arguments TorchRec's wrapper sets itself (see TorchRecStrategy._dense_ddp).
_SET_BY_TORCHREC = frozenset({"module", "device_ids", "process_group", "gradient_as_bucket_view", "broadcast_buffers"})

def _torchrec_optimizer(config: RowWiseOptimizerConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """TorchRec's optimizer for our rule: its fused kernels do SGD and row-wise Adagrad with
    our math (FBGEMM's EXACT_*); its Adam is not row-lazy (and has no CPU kernel)."""
    import torchrec.optim as trec_optim

    if config.name == "sgd":
        return torch.optim.SGD, {"lr": config.lr}
    if config.name == "rowwise_adagrad":
        return trec_optim.RowWiseAdagrad, {"lr": config.lr, "eps": config.eps}
    raise ValueError(
        f"The torchrec strategy trains embeddings with TorchRec's fused optimizers, which have no row-lazy "
        f"{config.name!r}; use sgd or rowwise_adagrad, or the auto/hotcache strategies."
    )


# TorchRec's (FBGEMM's) name of a table's row-wise state array -> ours
# (`RowWiseOptimizerConfig.state_widths`): row-wise Adagrad's one value per row, kept by
# TorchRec as (rows,), by us as (rows, 1).
_FUSED_STATE_NAMES = {"momentum1": "momentum"}


def _our_state_name(fused_name: str) -> str:
    """A fused optimizer state's key (``<table>.momentum1``) -> our name of the array."""
    return _FUSED_STATE_NAMES[fused_name.rsplit(".", 1)[1]]


def _shard_index(shard: Any) -> tuple[slice, ...]:
    """Where a ShardedTensor's local shard sits in the full tensor."""
    return tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))


def _row_state_key(parameter: str) -> str:
    """A table weight's parameter name (``<collection>.embedding_bags.<table>.weight``) -> its
    key in a checkpoint's row state (``<collection>.<table>``)."""
    collection, table = parameter.removesuffix(".weight").rsplit(".embedding_bags.", 1)
    return f"{collection}.{table}"


def refuse_sharded_tables(module: torch.nn.Module, who: str) -> None:
    """Raise where ``module``'s tables are TorchRec's sharded modules, which a fit under this
    strategy leaves in the model: no strategy fits from them (TorchRec's own would shard them
    again), and one that found no tables would train the rest around them."""
    from torchrec.distributed.types import ShardedModule

    if any(isinstance(m, ShardedModule) for m in module.modules()):
        raise ValueError(
            f"{who}: this model's embedding tables are TorchRec's sharded modules, left in it by an earlier fit under "
            "strategy='torchrec', and no fit starts from them. To train on, fit a new model from that fit's checkpoint "
            "(`trainer.fit(new_model, ckpt_path=...)`: it holds plain tables and their row-wise optimizer state, so the "
            "run goes on exactly, under any strategy), or load `trainer.strategy.lightning_module_state_dict()` into a "
            "new model."
        )


class TorchRecStrategy(LikeAutoInOneProcess):
    """Shard embedding tables with TorchRec's planner and DistributedModelParallel.

    Args:
        sharding_types: sharding types the planner may choose from (TorchRec's names). The
            default, ``table_wise``, runs FBGEMM's fused kernels, which learn what ``auto``
            learns (tested); TorchRec's ``data_parallel`` path (dense gradients, replicated
            tables) measured about 1e-4 apart after one SGD step on tiny tables, not yet
            explained, so it is opt-in. On CPU TorchRec supports these two.
        **kwargs: DDPStrategy options (process group backend, timeout, ...). The DDP settings
            (``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb`` and the rest of
            ``DistributedDataParallel``'s) go to the DDP that DistributedModelParallel wraps the
            dense layers in, with Lightning's defaults (TorchRec's own would force
            ``static_graph=True``), but for ``gradient_as_bucket_view=True`` and
            ``broadcast_buffers=False``, which TorchRec fixes. DDP communication hooks, model
            averaging (they need Lightning's own DDP module) and ``start_method`` other than
            ``"popen"`` (spawned processes would hand back sharded tensors, which cannot be
            pickled) are refused.

    TorchRec's fused optimizer state (row-wise Adagrad's momentum) lives inside its kernels;
    checkpoints hold it gathered, as the other strategies' row state, and a resume puts it
    back (from a checkpoint of any strategy). After a run the
    model is unwrapped (``trainer.model`` is the LightningModule again, as under DDP), but its
    tables stay TorchRec's sharded modules; checkpoints and ``lightning_module_state_dict()``
    hold plain tensors.
    """

    strategy_name = "torchrec"

    def __init__(self, sharding_types: Sequence[str] = ("table_wise",), **kwargs: Any) -> None:
        refused = {name: kwargs[name] for name, default in _UNSUPPORTED_SETTINGS.items() if kwargs.get(name, default) != default}
        if refused:
            raise ValueError(
                f"The torchrec strategy cannot honour {', '.join(f'{k}={v!r}' for k, v in refused.items())}: TorchRec's "
                "DistributedModelParallel builds the DDP of the dense layers itself, which Lightning's communication "
                "hooks and model averaging do not reach, and processes started other than by popen would hand back "
                "sharded tensors. Leave them out, or use strategy='ddp' or 'hotcache'."
            )
        # What goes to DistributedDataParallel (all that DDPStrategy does not take itself), less
        # what DistributedModelParallel's wrapper sets.
        strategy_settings = set(inspect.signature(DDPStrategy.__init__).parameters)
        self._dense_ddp_settings = {
            k: v for k, v in kwargs.items() if k not in strategy_settings and k not in _SET_BY_TORCHREC
        }
        super().__init__(**kwargs)
        self.sharding_types = list(sharding_types)
        self.sharding_plan: Any = None
        # A restored checkpoint's row state, put into the fused optimizer once sharding built it.
        self._restored_row_state: Mapping[str, Mapping[str, torch.Tensor]] = {}
        # TorchRec's fused optimizer of the sharded tables; kept past teardown, which unwraps
        # the model, so that a checkpoint saved after fit holds its state too.
        self._fused_optimizer: Any = None
        self._steps_rows_in_backward = False  # the model has tables, whose rows step in backward

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            refuse_sharded_tables(self.lightning_module, f"strategy={self.strategy_name!r}")
        self._steps_rows_in_backward = any(isinstance(m, EmbeddingBagCollection) for m in self.lightning_module.modules())
        if self._steps_rows_in_backward:
            refuse_gradient_accumulation(trainer, self.strategy_name)  # rows are stepped in backward
            refuse_half_true_precision(trainer, f"strategy={self.strategy_name!r}")
        if self.world_size > 1 and not self.lightning_module.automatic_optimization:
            # Lightning's manual optimization drives its own DDP module around the training step
            # (forward redirection, prepare_for_backward); the DDP inside DistributedModelParallel
            # gets none of it, and its second forward fails inside the first backward's bookkeeping.
            raise ValueError(
                "The torchrec strategy does not run manual optimization with several processes (the dense layers' "
                "DDP sits inside TorchRec's DistributedModelParallel, out of Lightning's reach). Use automatic "
                "optimization, one process, or strategy='ddp' or 'hotcache'."
            )
        super().setup(trainer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._steps_rows_in_backward:  # a callback may turn accumulation on mid-fit; no row has stepped yet
            refuse_gradient_accumulation_now(self.lightning_module.trainer, self.strategy_name)
        return super().training_step(*args, **kwargs)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        check_even_batches(dataloader, self.world_size, self.strategy_name)  # sharded lookups are all-to-alls
        return super().process_dataloader(dataloader)

    @override
    def configure_ddp(self) -> None:
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

        model = self.lightning_module
        collections = [m for m in model.modules() if isinstance(m, EmbeddingBagCollection)]
        config = getattr(model, "embedding_optimizer_config", None) or RowWiseOptimizerConfig()
        optimizer_class, optimizer_kwargs = _torchrec_optimizer(config)
        for collection in collections:
            apply_optimizer_in_backward(optimizer_class, collection.parameters(), optimizer_kwargs)
        constraints = {
            t.name: ParameterConstraints(sharding_types=self.sharding_types)
            for c in collections
            for t in c.embedding_bag_configs()
        }
        with _quiet_torchrec_planner():
            topology = Topology(
                world_size=self.world_size,
                compute_device=self.root_device.type,
                local_world_size=self.num_processes,
            )
            planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
            self.sharding_plan = planner.collective_plan(model, [EmbeddingBagCollectionSharder()], dist.group.WORLD)
        log.info("torchrec sharding plan:\n%s", self.sharding_plan)
        tables = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if self.world_size > 1:
            # Every rank starts from rank 0's weights, as under DDP: the copy back below would
            # otherwise give each rank its own initialization (dense layers included, undoing
            # the broadcast of the DDP that DMP wraps them in) whenever ranks are seeded apart.
            collectives.broadcast_from_rank_zero(tables.values())
        # Sharding draws fresh initial tables from the global RNG; the run must not see that
        # (it would then shuffle and drop out differently from `auto`).
        with global_rngs_restored():
            self.model = DistributedModelParallel(
                self.model, device=self.root_device, plan=self.sharding_plan, data_parallel_wrapper=self._dense_ddp()
            )
        # Sharding builds new tables with fresh initial values: put the model's own back
        # (its initialization, or the weights a checkpoint restored before setup), and the
        # restored row state into the fresh fused optimizer.
        self._copy_into_shards(tables)
        self._fused_optimizer = self.model.fused_optimizer
        self._load_fused_row_state(self._restored_row_state, config)
        self._restored_row_state = {}

    def _dense_ddp(self) -> Any:
        """How DistributedModelParallel wraps the dense layers: in a DDP with this strategy's
        settings, on Lightning's defaults rather than TorchRec's (which force a static graph)."""
        from torchrec.distributed.model_parallel import DefaultDataParallelWrapper

        settings = dict(self._dense_ddp_settings)
        return DefaultDataParallelWrapper(
            bucket_cap_mb=settings.pop("bucket_cap_mb", None) or 25,  # DDP's default, as None means there
            static_graph=settings.pop("static_graph", False),
            find_unused_parameters=settings.pop("find_unused_parameters", False),
            ddp_kwargs=settings,
        )

    @override
    def teardown(self) -> None:
        from torchrec.distributed import DistributedModelParallel

        if isinstance(self.model, DistributedModelParallel):  # as DDPStrategy unwraps its DDP
            self.model = self.lightning_module
        self._restored_row_state = {}  # a validate's restored state is no later fit's
        super().teardown()

    @torch.no_grad()
    def _copy_into_shards(self, full: dict[str, torch.Tensor]) -> None:
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        for key, value in self.lightning_module.state_dict().items():
            if key not in full:
                continue
            if isinstance(value, ShardedTensor):
                for shard in value.local_shards():
                    shard.tensor.copy_(full[key][_shard_index(shard)])
            else:
                value.copy_(full[key])

    @torch.no_grad()
    def _load_fused_row_state(self, saved: Mapping[str, Mapping[str, torch.Tensor]], config: RowWiseOptimizerConfig) -> None:
        """Copy a checkpoint's row state (`ROW_STATE_KEY` format) into the fused optimizer's
        shards, every table checked before any is written."""
        if not saved:
            return
        optimizer = self._fused_optimizer
        state = optimizer.state_dict()["state"]
        copies = []
        for parameter in optimizer.params:
            key = _row_state_key(parameter)
            if key not in saved:
                continue
            config.check_saved_state(key, saved[key])
            for name, value in state.get(parameter, {}).items():
                copies.append((value, saved[key][_our_state_name(name)]))
        for value, values in copies:
            for shard in value.local_shards():
                shard.tensor.copy_(values.reshape(value.size())[_shard_index(shard)])

    def _gathered(self, size: torch.Size, dtype: torch.dtype, shards: Sequence[Any]) -> torch.Tensor:
        """A ShardedTensor of ``size`` as one plain CPU tensor, on every rank (a collective across
        ranks): ``shards`` are this rank's local shards of it (none where it holds no piece)."""
        full = torch.zeros(size, dtype=dtype, device=self.root_device)
        for shard in shards:
            full[_shard_index(shard)] = shard.tensor.to(self.root_device)
        if self.world_size > 1:  # each rank holds some tables: sum the zero-padded pieces
            collectives.all_reduce(full)
        return full.cpu()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full state dict with sharded tables gathered into plain tensors (on every rank)."""
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        state = self.lightning_module.state_dict()
        for key, value in state.items():
            if isinstance(value, ShardedTensor):
                state[key] = self._gathered(value.size(), value.dtype, value.local_shards())
        return state

    def fused_row_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The fused optimizer's row-wise state, gathered (on every rank) in the `ROW_STATE_KEY`
        format: ``"<collection>.<table>"`` -> state name -> (rows, width)."""
        if self._fused_optimizer is None:
            return {}
        local = {
            (parameter, name): value
            for parameter, arrays in self._fused_optimizer.state_dict()["state"].items()
            for name, value in arrays.items()
        }
        # Unlike the model's state dict, each rank's optimizer state holds only the tables it has
        # shards of: the ranks agree on every array first, then gather them in one order.
        arrays = {key: (value.size(), value.dtype) for key, value in local.items()}
        if self.world_size > 1:
            arrays = {key: spec for part in collectives.all_gather_object(arrays) for key, spec in part.items()}
        row_state: dict[str, dict[str, torch.Tensor]] = {}
        for (parameter, name), (size, dtype) in sorted(arrays.items()):
            rows = self._gathered(size, dtype, local[parameter, name].local_shards() if (parameter, name) in local else [])
            row_state.setdefault(_row_state_key(parameter), {})[_our_state_name(name)] = rows.view(len(rows), -1)
        return row_state

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        # Every rank saves (and takes part in the gathering); rank 0 writes.
        row_state = self.fused_row_state()
        if row_state:
            checkpoint[ROW_STATE_KEY] = {**checkpoint.get(ROW_STATE_KEY, {}), **row_state}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict)
        self._restored_row_state = checkpoint.get(ROW_STATE_KEY, {})
