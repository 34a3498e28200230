"""A batch on its way through a `HotColdEmbeddingBagCollection`: the KJT checks and reordering
done once at staging, and the staged batch every later part reads (its slots and tickets).

By hand with torch ops, not KeyedJaggedTensor.permute / offsets: those are FBGEMM ops, which
the CPU build of FBGEMM (what a CUDA machine without FBGEMM's CUDA build has) lacks for CUDA
tensors.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from lightning_hotcache._ops.compiled import without_gil
from lightning_hotcache._ops.sorting import sort_with_repeats


@dataclass(frozen=True)
class TableReads:
    """One device table's reads in a staged batch, for an update that sums each row's gradient
    itself (no sort in backward), all on the device.

    Found on the host while staging: ``rows`` are the distinct rows, ascending. Found on a
    CUDA device (`sorted_reads`), where sizing the distinct rows would make the host wait for
    the device: ``rows`` are every value's row, sorted, repeats kept, and ``segment`` says
    which distinct row each of them is (repeats step to the same values, so their writes agree).
    """

    rows: Tensor
    inverse: Tensor  # the distinct row (0, 1, ... in ascending order) of each value its features read (features end to end)
    segment: Tensor | None = None  # the distinct row of each of `rows`, where `rows` has repeats


def sorted_reads(rows: Tensor) -> TableReads:
    """`TableReads` of ``rows`` (every value's row) found where they are, in ops of fixed sizes:
    on a CUDA device none waits for the device, as ``unique`` would (its size)."""
    return TableReads(*sort_with_repeats(rows))


@dataclass
class StagedBatch:
    """A batch whose rows are resident and locked: the slot of every value, feature-major in
    the module's feature order (what FBGEMM's TBE reads)."""

    features: KeyedJaggedTensor  # as given (to recognize the batch in forward)
    ours: KeyedJaggedTensor  # its features of this module, in this module's order
    indices: Tensor  # slot of every value of `ours` (at its region's place in a shared device table)
    tickets: dict[str, list[int]]  # cache key (table, or a stack) -> cache tickets to release
    read: list[tuple[Any, Tensor]]  # each cache's distinct slots the batch read (to refresh across ranks)
    output: weakref.ref[Tensor] | None = None  # alive while a backward may still come
    # What the update across ranks keeps from forward for backward (see `OwnersUpdate`).
    exchange: Any = None
    # Per device table, its reads, where the update sums gradients itself (`Staging.sums_gradients`).
    reads: list[TableReads] = field(default_factory=list)
    # Caches whose directory is in device memory (`DirectoryStaging`): what each holds from the
    # batch's admission until its release.
    held: dict[str, Any] = field(default_factory=dict)
    # Staged inside a step a CUDA graph records (`step_graph.recording`): its device ops run only
    # in the graph's replays, so where the recording is refused it holds nothing.
    recorded: bool = False


def same_batch(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> bool:
    # Moving a batch to the device it is already on makes new KJT objects around the same
    # tensors, so compare storage, not identity.
    va, vb = a.values(), b.values()
    return a is b or (va.data_ptr() == vb.data_ptr() and va.shape == vb.shape and a.keys() == b.keys())


def bag_offsets(features: KeyedJaggedTensor) -> Tensor:
    """Offsets of every bag, feature-major (what TBE reads)."""
    offsets = features.offsets_or_none()
    if offsets is not None:
        return offsets
    lengths = features.lengths()
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


def runs_of(positions: list[int]) -> list[tuple[int, int]]:
    """``positions`` (ascending) as runs ``(first, end)`` of consecutive ones: features side by
    side in a batch are one span of its values, so cutting them out is a view, not a copy per
    feature."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


def concat_spans(values: Tensor, spans: list[tuple[int, int]]) -> Tensor:
    """``values[a:b]`` for each span, end to end (a view when there is one span). On the host
    one compiled call (a slice and a concatenation were a torch call per span: on a staging
    thread each hands the GIL over)."""
    if len(spans) == 1:
        return values[spans[0][0] : spans[0][1]]
    if values.device.type != "cpu" or values.requires_grad:
        return torch.cat([values[a:b] for a, b in spans])
    starts, ends = _bounds(spans)
    return torch.from_numpy(_concat_spans(values.numpy(), starts, ends))


def put_spans(target: Tensor, spans: list[tuple[int, int]], values: Tensor, offset: int = 0) -> None:
    """``target[a:b]`` for each span in turn, end to end, becomes ``values`` plus ``offset``
    (host tensors, ``values`` as long as the spans together): `concat_spans`'s inverse, one
    compiled call."""
    starts, ends = _bounds(spans)
    room = int((ends - starts).sum())
    if room != len(values) or (len(spans) and (starts.min() < 0 or ends.max() > len(target))):
        # Checked here: the compiled loop does not check its writes.
        raise ValueError(f"{len(values)} values for spans of {room} in all, within [0, {len(target)}): {spans}")
    _put_spans(target.numpy(), starts, ends, values.numpy(), offset)
    torch.autograd.graph.increment_version(target)  # written through numpy: marked changed, as torch's writes mark it


def _bounds(spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    bounds = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    return bounds[:, 0].copy(), bounds[:, 1].copy()


@without_gil
def _concat_spans(values, starts, ends):  # type: ignore[no-untyped-def]
    out = np.empty((ends - starts).sum(), values.dtype)
    at = 0
    for k in range(len(starts)):
        n = ends[k] - starts[k]
        out[at : at + n] = values[starts[k] : ends[k]]
        at += n
    return out


@without_gil
def _put_spans(target, starts, ends, values, offset):  # type: ignore[no-untyped-def]
    at = 0
    for k in range(len(starts)):
        for i in range(starts[k], ends[k]):
            target[i] = values[at] + offset
            at += 1


@without_gil
def _add_per_key(values, per_key, offsets):  # type: ignore[no-untyped-def]
    out = np.empty(len(values), np.int64)
    for key in range(len(per_key)):
        for i in range(offsets[key], offsets[key + 1]):
            out[i] = values[i] + per_key[key]
    return out


def add_per_key(values: Tensor, per_key: Tensor, offsets: list[int]) -> Tensor:
    """``values`` (on the host) as int64, plus ``per_key[k]`` for every value of key ``k``, key
    ``k``'s values being ``[offsets[k], offsets[k + 1])``: one compiled pass."""
    return torch.from_numpy(_add_per_key(values.numpy(), per_key.numpy(), np.asarray(offsets, dtype=np.int64)))


@without_gil
def _first_out_of_range(values, limits, offsets):  # type: ignore[no-untyped-def]
    for key in range(len(limits)):
        for i in range(offsets[key], offsets[key + 1]):
            if values[i] < 0 or values[i] >= limits[key]:
                return i
    return -1


def check_ids(features: KeyedJaggedTensor, tables: dict[str, EmbeddingBagConfig]) -> None:
    """Every id of every feature (each a key of ``tables``, feature -> table; on the host)
    within its table, checked in one compiled pass over the batch's values (staging does this
    on a thread, where torch's few ops per check each waited for the GIL); the first bad id is
    named."""
    values = features.values()
    if values.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"Features {features.keys()} have ids of dtype {values.dtype}; expected int32/int64.")
    keys, offsets = features.keys(), np.asarray(features.offset_per_key(), dtype=np.int64)
    limits = np.array([tables[k].num_embeddings for k in keys], dtype=np.int64)
    position = int(_first_out_of_range(values.numpy(), limits, offsets))
    if position < 0:
        return
    feature = keys[int(np.searchsorted(offsets, position, side="right")) - 1]
    table = tables[feature]
    raise ValueError(
        f"Feature {feature!r} of table {table.name!r} has id {int(values[position])}, outside [0, "
        f"{table.num_embeddings}). Hash or clip ids into the table's range (or enlarge num_embeddings); no row "
        "was touched."
    )


def check_one_batch_size(features: KeyedJaggedTensor) -> None:
    """Refuse a batch whose features have batch sizes of their own (TorchRec's variable batch
    per feature, VBE): the lookups and the output assume one batch size for all."""
    if features.variable_stride_per_key():
        raise ValueError(
            f"The batch has a batch size per feature (stride_per_key {features.stride_per_key()}: TorchRec's variable "
            "batch per feature), which HotColdEmbeddingBagCollection does not support: every feature must have one "
            "bag per sample. Build the KeyedJaggedTensor without stride_per_key_per_rank / inverse_indices (expand "
            "deduplicated features first), or train this collection under strategy='auto' or 'torchrec'."
        )


def in_feature_order(
    features: KeyedJaggedTensor,
    order: list[str],
    input_of: dict[str, str],
    table_of: dict[str, EmbeddingBagConfig],
    sized_like: KeyedJaggedTensor | None = None,
) -> KeyedJaggedTensor:
    """The values ``order``'s features read (``input_of`` says which input key each reads; a
    key may be read by several), keyed by ``order`` (as given when it already is).
    ``sized_like``: the same batch elsewhere, whose values per key are known (default:
    ``features``)."""
    check_one_batch_size(features)
    keys = features.keys()
    if keys == order:
        return features
    position = {f: k for k, f in enumerate(keys)}
    for feature in order:
        if input_of[feature] not in position:
            raise KeyError(
                f"Feature {input_of[feature]!r} of table {table_of[feature].name!r} is missing from the batch (it has {keys})."
            )
    picked = [position[input_of[f]] for f in order]
    batch, per_key = features.stride(), (features if sized_like is None else sized_like).length_per_key()

    def reordered(flat: Tensor, sizes: int | list[int]) -> Tensor:
        parts = flat.split(sizes)
        return torch.cat([parts[k] for k in picked])

    weights = features.weights_or_none()
    return KeyedJaggedTensor(
        keys=list(order),
        values=reordered(features.values(), per_key),
        lengths=reordered(features.lengths(), batch),
        weights=None if weights is None else reordered(weights, per_key),
        stride=batch,
    )


def on_device(
    arriving: KeyedJaggedTensor,
    host: KeyedJaggedTensor,
    host_ours: KeyedJaggedTensor,
    order: list[str],
    input_of: dict[str, str],
    table_of: dict[str, EmbeddingBagConfig],
) -> KeyedJaggedTensor:
    """``arriving`` (the batch on the device; ``host``: the same batch on the host) in the
    module's feature order, with the sizes per feature that ``host_ours`` (that order, on the
    host) knows: a KJT computes them from its lengths, which on the device would wait for it."""
    ours = in_feature_order(arriving, order, input_of, table_of, sized_like=host)
    return KeyedJaggedTensor(
        keys=ours.keys(),
        values=ours.values(),
        lengths=ours.lengths(),
        weights=ours.weights_or_none(),
        stride=ours.stride(),
        length_per_key=host_ours.length_per_key(),
        offset_per_key=host_ours.offset_per_key(),
    )
