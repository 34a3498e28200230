"""TorchRecStrategy: the baseline, TorchRec's own sharding (DistributedModelParallel) under Lightning.

Lightning launches the processes and the process group as for DDP; instead of wrapping the
model in DDP, the strategy shards its EmbeddingBagCollections with a plan from TorchRec's
EmbeddingShardingPlanner and lets DistributedModelParallel wrap the dense rest in DDP.
Embedding rows are trained by TorchRec's fused in-backward optimizer set to the model's
row-wise rule (``model.embedding_optimizer_config``), so the zoo models learn the same
thing as under ``auto`` and ``hotcache``. Process-group set-up and wrapping stay here, out of
the model (unlike torchrecipes' TorchrecStrategy, which put them in the model).

Checkpoints gather sharded tables into plain tensors under the plain keys, so they load
under any strategy.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Sequence

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torchrec import EmbeddingBagCollection
from typing_extensions import override

from lightning_hotcache import collectives
from lightning_hotcache.accumulation import refuse_gradient_accumulation
from lightning_hotcache.even_batches import check_even_batches
from lightning_hotcache.like_auto import LikeAutoInOneProcess, global_rngs_restored
from lightning_hotcache.planner import _quiet_torchrec_planner
from lightning_hotcache.rowwise import RowWiseOptimizerConfig

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


def _shard_index(shard: Any) -> tuple[slice, ...]:
    """Where a ShardedTensor's local shard sits in the full tensor."""
    return tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))


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

    TorchRec's fused optimizer state (e.g. row-wise Adagrad's momentum) lives inside its
    kernels and is not in Lightning checkpoints yet: resuming restarts it. After a run the
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

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if any(isinstance(m, EmbeddingBagCollection) for m in self.lightning_module.modules()):
            refuse_gradient_accumulation(trainer, self.strategy_name)  # rows are stepped in backward
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
        # (its initialization, or the weights a checkpoint restored before setup).
        self._copy_into_shards(tables)

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

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full state dict with sharded tables gathered into plain tensors (on every rank)."""
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        state = self.lightning_module.state_dict()
        for key, value in state.items():
            if isinstance(value, ShardedTensor):
                full = torch.zeros(value.size(), dtype=value.dtype, device=self.root_device)
                for shard in value.local_shards():
                    full[_shard_index(shard)] = shard.tensor.to(self.root_device)
                if self.world_size > 1:  # each rank holds some tables: sum the zero-padded pieces
                    collectives.all_reduce(full)
                state[key] = full.cpu()
        return state
