"""Device tier on FBGEMM's table-batched embedding (TBE): the kernel TorchRec's fused tables run.

One `SplitTableBatchedEmbeddingBagsCodegen` holds the device slots of every table of a
collection (whole tables as they are; split tables as their static + dynamic slots). A
batch is one kernel call on slot ids, and backward updates the rows it read with the
row-wise rule fused in (EXACT_SGD, EXACT_ROWWISE_ADAGRAD): no per-table Python, no
sparse gradient tensors. Each table's `DeviceCache` works in place on the TBE's own memory
through its per-table views (`split_embedding_weights`, `split_optimizer_states`), so
filling and evicting slots move rows and their optimizer state with batched index copies.

Where the fused path cannot give exactly the rule the rest of the library applies, the
pure-PyTorch path runs instead, and `fused_unavailable` says why (the plan prints it).
"""

from __future__ import annotations

import functools
from typing import Literal, Sequence

import torch
from torch import Tensor
from torchrec import EmbeddingBagConfig
from torchrec.modules.embedding_configs import PoolingType

from lightning_hotcache.cache.host_arrays import move_to_huge_pages
from lightning_hotcache.optim.rowwise import RowWiseOptimizerConfig

KernelChoice = Literal["auto", "fbgemm", "triton", "pytorch"]
KERNEL_CHOICES: tuple[str, ...] = ("auto", "fbgemm", "triton", "pytorch")


def check_kernel_choice(kernel: str) -> None:
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"kernel must be one of {KERNEL_CHOICES}, got {kernel!r}.")


def fused_unavailable(
    tables: Sequence[EmbeddingBagConfig], optimizer: RowWiseOptimizerConfig, device: torch.device
) -> str | None:
    """Why FBGEMM's fused kernel cannot train these tables exactly here; None when it can."""
    if optimizer.name not in ("sgd", "rowwise_adagrad"):
        return (
            f"{optimizer.name}: FBGEMM's Adam corrects bias by one global step count, the library's lazy Adam by "
            "each row's own"
        )
    odd = [t.name for t in tables if t.embedding_dim % 4]
    if odd:
        return f"FBGEMM's TBE needs embedding dims that are multiples of 4 (not those of {', '.join(odd)})"
    if len({t.pooling for t in tables}) > 1:
        return "tables mix SUM and MEAN pooling (one TBE has one pooling mode)"
    if device.type not in ("cpu", "cuda"):
        return f"no FBGEMM kernels for {device.type} devices"
    try:
        _tbe_classes()
    except ImportError as err:
        return f"fbgemm_gpu is not importable ({err})"
    if device.type == "cuda" and not _cuda_kernels_present():
        return "the installed fbgemm_gpu has no CUDA kernels (a CPU build)"
    return None


def _tbe_classes() -> tuple[type, type, type, type, type]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice

    return EmbOptimType, SparseType, EmbeddingLocation, PoolingMode, ComputeDevice


@functools.cache  # one probe per process, not one per collection built
def _cuda_kernels_present() -> bool:
    try:
        tables = FusedTables([2], [4], [0], PoolingType.SUM, RowWiseOptimizerConfig("sgd"), torch.device("cuda"))
        tables(torch.zeros(1, dtype=torch.int64, device="cuda"), torch.tensor([0, 1], device="cuda"))
    except (RuntimeError, NotImplementedError):
        return False
    return True


class FusedTables:
    """The device slots of several tables in one FBGEMM TBE, with the optimizer fused.

    Deliberately not an ``nn.Module`` attribute of the collection: the TBE's parameters and
    buffers must stay out of the model's ``parameters()`` (no dense optimizer may touch
    them) and ``state_dict()`` (which keeps torchrec's keys).

    Args:
        slot_counts: rows of each table's device tier.
        dims: each table's row width.
        feature_table_map: TBE table of each feature, in the order features are passed.
        pooling: SUM or MEAN for all tables.
        optimizer: SGD or row-wise Adagrad (see `fused_unavailable`).
        device: CPU (host memory, FBGEMM's CPU kernels) or CUDA (HBM).
        feature_groups: the model's table of each feature, when several of the model's tables
            share one TBE table (a stack): on CPU each group then gets a hash segment of its
            own (see `_split_hash_space`). Features of one group must be consecutive.
    """

    def __init__(
        self,
        slot_counts: Sequence[int],
        dims: Sequence[int],
        feature_table_map: Sequence[int],
        pooling: PoolingType,
        optimizer: RowWiseOptimizerConfig,
        device: torch.device,
        feature_groups: Sequence[int] | None = None,
    ) -> None:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

        EmbOptimType, SparseType, EmbeddingLocation, PoolingMode, ComputeDevice = _tbe_classes()
        on_cuda = device.type == "cuda"
        location = EmbeddingLocation.DEVICE if on_cuda else EmbeddingLocation.HOST
        compute = ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU
        rule = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[optimizer.name]
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(rows, dim, location, compute) for rows, dim in zip(slot_counts, dims)],
            feature_table_map=list(feature_table_map),
            optimizer=rule,
            learning_rate=optimizer.lr,
            eps=optimizer.eps,
            pooling_mode=PoolingMode.SUM if pooling == PoolingType.SUM else PoolingMode.MEAN,
            weights_precision=SparseType.FP32,
            output_dtype=SparseType.FP32,
            device=device,
        )
        if not on_cuda:
            if feature_groups is not None:
                self._split_hash_space(feature_groups, slot_counts, feature_table_map)
            # The rows and their state, read and updated at random: on 2 MiB pages where the
            # kernel grants them (see `host_arrays`; in place, so views stay valid).
            for array in (self.tbe.weights_host, getattr(self.tbe, "momentum1_host", None)):
                if isinstance(array, Tensor):
                    move_to_huge_pages(array.data)
        weights = self.tbe.split_embedding_weights()
        states = self.tbe.split_optimizer_states() if optimizer.name == "rowwise_adagrad" else [[] for _ in weights]
        # Views of the TBE's memory through which the caches write rows. ``.data``, not
        # ``detach()``: a detached view shares the TBE weights' version counter, so filling
        # a free slot (from the prefetch thread, between a step's forward and backward)
        # would fail autograd's check of the weights the lookup saved for backward, though
        # that backward only updates the step's own, locked, rows.
        self._storage = []
        for weight, state in zip(weights, states):
            arrays = {"weight": weight.data}
            if state:
                arrays["momentum"] = state[0].data.view(-1, 1)
            self._storage.append(arrays)

    def _split_hash_space(self, groups: Sequence[int], slot_counts: Sequence[int], feature_table_map: Sequence[int]) -> None:
        """Make FBGEMM's CPU backward see each group of features as a table of its own.

        That backward finds tables as runs of features with equal ``hash_size_cumsum``. All
        features of a stack read one TBE table, so it sees one table shared by every feature
        and takes its serial loop, where a table read by one feature takes FBGEMM's parallel
        JIT kernel, which steps faster (row-wise Adagrad among them; benchmarks/README.md).
        Giving each group a segment of the hash space of the size of the TBE table it
        reads keeps every feature's rows and optimizer state where they are (``weights_offsets``
        and ``momentum1_offsets`` are per feature and unchanged), and the groups' rows are
        disjoint, so each row still gets one update with all its gradient. CPU only: CUDA
        kernels linearize ids by ``hash_size_cumsum`` and would need its bit width too.
        """
        if len(groups) != len(feature_table_map) or any(a > b for a, b in zip(groups, groups[1:])):
            raise ValueError(f"feature_groups must give each of the {len(feature_table_map)} features a group, in order.")
        # A group's segment is as long as the TBE table its features read.
        starts = [0]
        for k in range(1, len(groups)):
            new_group = groups[k] != groups[k - 1]
            starts.append(starts[-1] + (slot_counts[feature_table_map[k - 1]] if new_group else 0))
        starts.append(starts[-1] + slot_counts[feature_table_map[-1]])
        self.tbe.hash_size_cumsum.copy_(torch.tensor(starts))

    def storage(self, table: int) -> dict[str, Tensor]:
        """Views of one table's slots: ``weight`` (rows, dim) and its optimizer state (rows, width)."""
        return self._storage[table]

    def __call__(self, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None = None) -> Tensor:
        """Pooled rows, (batch, sum of the features' dims); backward updates the rows read."""
        return self.tbe(indices, offsets, per_sample_weights)
