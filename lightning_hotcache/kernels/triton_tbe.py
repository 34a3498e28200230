"""A table-batched embedding in Triton: pooled lookups over a stack of tables of one width, and
a backward that applies the row-wise rule to each distinct row inside the kernel.

Why by hand: FBGEMM's CUDA build must match torch and CUDA exactly and is often missing on a
new GPU or an offline node; TorchRec's upstream Triton TBE is forward-only for caches and not in
the release we pin. Triton ships with every CUDA build of torch, so this runs wherever torch does.

Layout (TorchRec's, FBGEMM's TBE): ``indices`` are rows of ``weight`` (a stack: each table's
rows after the previous table's), ``offsets`` (``num_bags + 1``) cut them into bags, and the
bags are feature-major (bag ``f * batch + b``). The output is one pooled row per bag,
``(num_bags, dim)``. Each bag pools by sum, or by mean where ``bag_mean`` says so (mixed
pooling in one launch), with optional per-sample weights. An empty bag pools to zeros.

The backward sorts the batch's rows once (a fixed-size sort: no count reaches the host), so
that each row's values form a run, and sums each run's gradient rows (each bag's output
gradient, scaled by the value's weight and, for mean bags, by one over the bag's length)
before stepping the row once by the row-wise rule, as `RowWiseOptimizerConfig` writes it: SGD,
row-wise Adagrad (``acc += mean(g**2)``, ``w -= lr * g / (sqrt(acc) + eps)``) or lazy Adam (the
row's moments, and its bias correction by its own count of steps). The sorted positions go to
programs in fixed chunks (a segmented scan sums each run's piece in a chunk), and a second
launch sums and steps the runs that cross a chunk's edge: in CTR data a few rows are read by
thousands of a batch's values (a table of three rows, the head of a power law), and one program
summing such a run alone would hold the whole step up. No ``.item()``, ``nonzero`` or
``unique`` whose size the host must learn, so the step can be captured in a CUDA graph.

Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (slowly): the tests compare them
there against ``embedding_bag`` and the PyTorch row step.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU builds do not bring Triton
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

# Each rule the kernels apply, and the per-row state arrays it reads and writes, in the order
# the kernels take them (`RowWiseOptimizerConfig.state_widths` names the same arrays).
_STATE_OF_RULE: dict[str, tuple[str, ...]] = {
    "sgd": (),
    "rowwise_adagrad": ("momentum",),
    "adam": ("exp_avg", "exp_avg_sq", "step"),
}
_RULE_IDS = {rule: k for k, rule in enumerate(_STATE_OF_RULE)}  # the kernels' RULE


def interpreted() -> bool:
    """Whether Triton runs its kernels on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def why_unavailable(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (None where they can)."""
    if triton is None:
        return "Triton is not installed (it ships with torch's CUDA builds; `pip install triton` elsewhere)"
    if device.type == "cuda" or (device.type == "cpu" and interpreted()):
        return None
    if device.type == "cpu":
        return "Triton's kernels run on CUDA devices (on a CPU only under TRITON_INTERPRET=1, for tests)"
    return f"Triton's kernels run on CUDA devices, not {device.type}"


def _block(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


# The backward's sorted positions go to programs in chunks of _CHUNK: a run of one row within a
# chunk is summed and stepped there, and a run across chunks' edges by a second launch that adds
# its chunks' pieces, _SPAN chunks at a time. A hot row read by thousands of a batch's values
# thus costs a few loads of summed pieces, not thousands of loads in one program.
_CHUNK = 32
_SPAN = 16
# The forward pools _PER_PROGRAM bags a program, side by side: their j-th values are read
# together while a bag has one, so a program has a row of each bag in flight at once (one-hot
# bags: one load of eight rows). Bags are feature-major, so a program's bags are one feature's,
# whose lengths are alike; it runs to its longest. `move_rows` moves as many slots a program.
_PER_PROGRAM = 8


if triton is not None:

    @triton.jit
    def _row_address(weight, host, at, weight_stride, host_stride, TWO_TIERS: tl.constexpr):
        """Where the row at location ``at`` (a scalar or a vector of them) starts: in ``weight``,
        or with ``TWO_TIERS`` where ``at < 0`` row ``-at - 1`` of ``host``."""
        address = weight + at * weight_stride
        if TWO_TIERS:
            address = tl.where(at < 0, host + (-at - 1) * host_stride, address)
        return address

    @triton.jit
    def _pooled_kernel(
        weight, host, indices, offsets, per_sample, bag_mean, out, num_bags, dim, weight_stride, host_stride, out_stride,
        HAS_WEIGHTS: tl.constexpr, HAS_MEAN: tl.constexpr, TWO_TIERS: tl.constexpr, BAGS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        bags = tl.program_id(0).to(tl.int64) * BAGS + tl.arange(0, BAGS)
        real = bags < num_bags
        start = tl.load(offsets + bags, mask=real, other=0)
        length = tl.load(offsets + bags + 1, mask=real, other=0) - start
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        acc = tl.zeros([BAGS, BLOCK], dtype=tl.float32)
        for j in range(0, tl.max(length, 0)):  # each bag's j-th value, while it has one
            has = j < length
            at = tl.load(indices + start + j, mask=has, other=0).to(tl.int64)
            address = _row_address(weight, host, at, weight_stride, host_stride, TWO_TIERS)[:, None] + cols[None, :]
            values = tl.load(address, mask=has[:, None] & mask[None, :], other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                values = values * tl.load(per_sample + start + j, mask=has, other=0.0).to(tl.float32)[:, None]
            acc += values
        if HAS_MEAN:
            mean = tl.load(bag_mean + bags, mask=real, other=0) != 0
            acc = tl.where(mean[:, None], acc / tl.maximum(length, 1).to(tl.float32)[:, None], acc)
        tl.store(out + bags[:, None] * out_stride + cols[None, :], acc, mask=real[:, None] & mask[None, :])

    @triton.jit
    def _step_rows(
        weight, host, s1, s2, s3, h1, h2, h3, at, g, take, cols, mask, dim, weight_stride, host_stride, state_stride,
        host_state_stride, lr, eps, beta1, beta2, rest1, rest2, RULE: tl.constexpr, TWO_TIERS: tl.constexpr,
    ):  # fmt: skip
        """Step the rows at locations ``at`` (a vector) where ``take`` holds, each from its
        summed gradient, a row of ``g``, by ``RULE`` (`_RULE_IDS`): SGD; row-wise Adagrad, its
        momentum in ``s1`` (one a row); or lazy Adam, its moments in ``s1`` and ``s2`` (rows of
        ``dim``, ``state_stride`` apart), each row's count of steps in ``s3``. ``h1``-``h3`` are
        the host rows' state. ``rest1`` and ``rest2`` are ``1 - beta1`` and ``1 - beta2``,
        rounded as torch rounds them."""
        both = take[:, None] & mask[None, :]
        address = _row_address(weight, host, at, weight_stride, host_stride, TWO_TIERS)[:, None] + cols[None, :]
        w = tl.load(address, mask=both, other=0.0)
        if RULE == 1:
            state = _row_address(s1, h1, at, 1, 1, TWO_TIERS)
            acc = tl.load(state, mask=take, other=0.0) + tl.sum(g * g, axis=1) / dim
            tl.store(state, acc, mask=take)
            w = w - lr * g / (tl.sqrt(acc)[:, None] + eps)
        elif RULE == 2:
            counts = _row_address(s3, h3, at, 1, 1, TWO_TIERS)
            step = tl.load(counts, mask=take, other=0.0) + 1.0
            tl.store(counts, step, mask=take)
            first = _row_address(s1, h1, at, state_stride, host_state_stride, TWO_TIERS)[:, None] + cols[None, :]
            second = _row_address(s2, h2, at, state_stride, host_state_stride, TWO_TIERS)[:, None] + cols[None, :]
            m = tl.load(first, mask=both, other=0.0)
            m = m + rest1 * (g - m)  # torch's lerp for a weight below one half
            v = tl.load(second, mask=both, other=0.0) * beta2 + rest2 * g * g
            tl.store(first, m, mask=both)
            tl.store(second, v, mask=both)
            w = w - lr * (m / _bias_correction(beta1, step)[:, None]) / (tl.sqrt(v / _bias_correction(beta2, step)[:, None]) + eps)
        else:
            w = w - lr * g
        tl.store(address, w, mask=both)

    @triton.jit
    def _bias_correction(beta, step):
        """``1 - beta ** step`` as torch gives it for a float32 ``beta``: the power in float64
        rounded to float32 (a correctly rounded float32 power), then the difference in float32,
        whose cancellation at small ``step`` is torch's too."""
        base = (tl.zeros_like(step) + beta).to(tl.float64)
        return 1.0 - tl.exp2(step.to(tl.float64) * tl.log2(base)).to(tl.float32)

    @triton.jit
    def _chunk_runs(sorted_rows, first, num_values, CHUNK: tl.constexpr):
        """The positions ``first + [0, CHUNK)`` of the sorted locations: each one's location,
        whether it is a position at all, and whether it starts or ends a run of one location."""
        q = first + tl.arange(0, CHUNK)
        valid = q < num_values
        rows = tl.load(sorted_rows + q, mask=valid, other=0)
        starts = valid & ((q == 0) | (rows != tl.load(sorted_rows + q - 1, mask=valid & (q > 0), other=0)))
        last = q + 1 >= num_values
        ends = valid & (last | (rows != tl.load(sorted_rows + q + 1, mask=valid & ~last, other=0)))
        return q, valid, rows, starts, ends

    @triton.jit
    def _sum_within_runs(started_a, sum_a, started_b, sum_b):
        """The combination of a scan whose running sums restart where a run starts."""
        return started_a | started_b, tl.where(started_b != 0, sum_b, sum_a + sum_b)

    @triton.jit
    def _backward_chunks_kernel(
        weight, host, s1, s2, s3, h1, h2, h3, sorted_rows, order, bag_of_value, scale, grad, heads, tails,
        num_values, dim, weight_stride, host_stride, state_stride, host_state_stride, grad_stride, lr, eps, beta1, beta2, rest1, rest2,
        RULE: tl.constexpr, TWO_TIERS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        c = tl.program_id(0).to(tl.int64)
        first = c * CHUNK
        q, valid, rows, starts, ends = _chunk_runs(sorted_rows, first, num_values, CHUNK)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        value = tl.load(order + q, mask=valid, other=0)
        bag = tl.load(bag_of_value + value, mask=valid, other=0).to(tl.int64)
        both = valid[:, None] & mask[None, :]
        g = tl.load(grad + bag[:, None] * grad_stride + cols[None, :], mask=both, other=0.0).to(tl.float32)
        g = g * tl.load(scale + value, mask=valid, other=0.0)[:, None]
        # Each position's gradient summed over its run up to it, within the chunk.
        restarts = (starts[:, None] & (cols[None, :] >= 0)).to(tl.int32)
        _, sums = tl.associative_scan((restarts, g), 0, _sum_within_runs)
        begun_here = tl.cumsum(starts.to(tl.int32), 0) > 0
        piece_ends = valid & (ends | (q == first + CHUNK - 1))
        # A run wholly in the chunk is stepped here; the pieces of a run that crosses a chunk's
        # edge wait for `_long_runs_kernel`: its first chunk's in ``tails``, the others' in ``heads``.
        _step_rows(weight, host, s1, s2, s3, h1, h2, h3, rows, sums, begun_here & ends, cols, mask, dim, weight_stride, host_stride,
                   state_stride, host_state_stride, lr, eps, beta1, beta2, rest1, rest2, RULE, TWO_TIERS)  # fmt: skip
        head = piece_ends & ~begun_here
        tail = piece_ends & begun_here & ~ends
        tl.store(heads + c * dim + cols, tl.sum(tl.where(head[:, None], sums, 0.0), axis=0), mask=mask)
        tl.store(tails + c * dim + cols, tl.sum(tl.where(tail[:, None], sums, 0.0), axis=0), mask=mask)

    @triton.jit
    def _long_runs_kernel(
        weight, host, s1, s2, s3, h1, h2, h3, sorted_rows, heads, tails, num_values, num_chunks, dim,
        weight_stride, host_stride, state_stride, host_state_stride, lr, eps, beta1, beta2, rest1, rest2,
        RULE: tl.constexpr, TWO_TIERS: tl.constexpr, CHUNK: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        c = tl.program_id(0).to(tl.int64)
        _, _, _, starts, ends = _chunk_runs(sorted_rows, c * CHUNK, num_values, CHUNK)
        last = tl.minimum(c * CHUNK + CHUNK, num_values) - 1
        # The chunk's last run crosses into the next chunk and began in this one: this program
        # sums its pieces (later chunks' pieces while they start with its location) and steps it.
        at_last = tl.arange(0, CHUNK) == last - c * CHUNK
        crosses = tl.sum(tl.where(at_last & ~ends, 1, 0), 0) > 0
        if crosses & (tl.sum(starts.to(tl.int32), 0) > 0):
            row = tl.load(sorted_rows + last)
            cols = tl.arange(0, BLOCK)
            mask = cols < dim
            g = tl.load(tails + c * dim + cols, mask=mask, other=0.0)
            k = c + 1
            more = True
            while more:
                span = k + tl.arange(0, SPAN)
                inside = (span < num_chunks) & (tl.load(sorted_rows + span * CHUNK, mask=span < num_chunks, other=0) == row)
                pieces = tl.load(heads + span[:, None] * dim + cols[None, :], mask=inside[:, None] & mask[None, :], other=0.0)
                g += tl.sum(pieces, axis=0)
                more = tl.sum(inside.to(tl.int32), 0) == SPAN
                k += SPAN
            one = tl.arange(0, 1) == 0
            _step_rows(weight, host, s1, s2, s3, h1, h2, h3, row + tl.zeros([1], dtype=row.dtype), g[None, :], one, cols, mask, dim,
                       weight_stride, host_stride, state_stride, host_state_stride, lr, eps, beta1, beta2, rest1, rest2,
                       RULE, TWO_TIERS)  # fmt: skip

    @triton.jit
    def _move_rows_kernel(
        slots_array, host_array, slots, write_rows, fill_rows, count, width, slot_stride, host_stride,
        ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        real = i < count
        slot = tl.load(slots + i, mask=real, other=0).to(tl.int64)
        written = tl.load(write_rows + i, mask=real, other=-1).to(tl.int64)
        filled = tl.load(fill_rows + i, mask=real, other=-1).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        at_slot = slots_array + slot[:, None] * slot_stride + cols[None, :]
        writes = (written >= 0)[:, None] & mask[None, :]
        tl.store(host_array + written[:, None] * host_stride + cols[None, :], tl.load(at_slot, mask=writes), mask=writes)
        fills = (filled >= 0)[:, None] & mask[None, :]  # after its write-back: the same program, the same slot
        tl.store(at_slot, tl.load(host_array + filled[:, None] * host_stride + cols[None, :], mask=fills), mask=fills)


def pooled(
    weight: Tensor,
    indices: Tensor,
    offsets: Tensor,
    bag_mean: Tensor | None = None,
    per_sample_weights: Tensor | None = None,
    host_weight: Tensor | None = None,
) -> Tensor:
    """One pooled row per bag, ``(len(offsets) - 1, dim)`` float32: each bag's rows of
    ``weight`` summed (times ``per_sample_weights``), averaged where ``bag_mean`` (one flag a
    bag) is set. One launch for every bag of the stack. With ``host_weight`` the indices are
    locations (`location_of_host_row`): a negative one reads its row of ``host_weight`` in place
    (memory the kernel can reach: on CUDA, host memory mapped into the device's address space)."""
    num_bags, dim = offsets.numel() - 1, weight.shape[1]
    out = torch.empty(num_bags, dim, dtype=torch.float32, device=weight.device)
    if num_bags == 0:
        return out
    bag_mean = None if bag_mean is None else bag_mean.to(torch.int32)
    host = weight if host_weight is None else host_weight
    _pooled_kernel[(triton.cdiv(num_bags, _PER_PROGRAM),)](
        weight, host, indices, offsets, per_sample_weights if per_sample_weights is not None else out,
        bag_mean if bag_mean is not None else offsets, out, num_bags, dim, weight.stride(0), host.stride(0), out.stride(0),
        HAS_WEIGHTS=per_sample_weights is not None, HAS_MEAN=bag_mean is not None, TWO_TIERS=host_weight is not None,
        BAGS=_PER_PROGRAM, BLOCK=_block(dim),
    )  # fmt: skip
    return out


def location_of_host_row(rows: Tensor) -> Tensor:
    """The location a kernel reads host row ``r`` at: ``-r - 1`` (slots are ``>= 0``)."""
    return -rows - 1


def value_scales(offsets: Tensor, num_values: int, bag_mean: Tensor | None, per_sample_weights: Tensor | None) -> tuple[Tensor, Tensor]:
    """Each value's bag and the factor its bag's output gradient reaches its row with (its
    weight, over its bag's length in a mean bag): fixed-size device ops, nothing for the host."""
    lengths = offsets.diff()
    bags = torch.arange(lengths.numel(), device=offsets.device)
    bag_of_value = torch.repeat_interleave(bags, lengths, output_size=num_values)
    scale = torch.ones(num_values, dtype=torch.float32, device=offsets.device)
    if per_sample_weights is not None:
        scale = scale * per_sample_weights.to(torch.float32)
    if bag_mean is not None:
        per_bag = torch.where(bag_mean.bool(), 1.0 / lengths.clamp(min=1).to(torch.float32), 1.0)
        scale = scale * per_bag.index_select(0, bag_of_value)
    return bag_of_value, scale


def backward_step(
    weight: Tensor,
    grad: Tensor,
    indices: Tensor,
    offsets: Tensor,
    rule: str,
    lr: float,
    eps: float,
    state: dict[str, Tensor] | None = None,
    bag_mean: Tensor | None = None,
    per_sample_weights: Tensor | None = None,
    host_weight: Tensor | None = None,
    host_state: dict[str, Tensor] | None = None,
    betas: tuple[float, float] = (0.9, 0.999),
) -> None:
    """Step the rows of ``weight`` the bags read, in place, from ``grad`` (the pooled output's
    gradient, one row per bag): each distinct row once, from its summed gradient, by ``rule``
    (``sgd``; ``rowwise_adagrad``, ``state["momentum"]`` one value a row; ``adam`` with
    ``betas``, ``state``'s ``exp_avg`` and ``exp_avg_sq`` rows of ``weight``'s width and
    ``step`` one value a row). One sort and two launches for the whole stack. With
    ``host_weight`` (and ``host_state``) the indices are locations, as for `pooled`: a row read
    from the host is stepped there, in place. A row must have one location in a batch."""
    names = _state_names(rule)
    slot_arrays = _state_arrays(names, state, f"{rule} needs the rows'")
    if host_weight is None:
        host_arrays = slot_arrays
    else:
        host_arrays = _state_arrays(names, host_state, f"{rule} on rows read from the host needs the host rows'")
    num_values = indices.numel()
    if num_values == 0:
        return
    bag_of_value, scale = value_scales(offsets, num_values, bag_mean, per_sample_weights)
    sorted_rows, order = torch.sort(indices.to(torch.int64), stable=True)
    grad = grad.contiguous()
    host = weight if host_weight is None else host_weight
    dim = weight.shape[1]
    num_chunks = triton.cdiv(num_values, _CHUNK)
    heads = torch.empty(num_chunks, dim, dtype=torch.float32, device=weight.device)
    tails = torch.empty_like(heads)
    arrays = (weight, host, *_three(slot_arrays, weight), *_three(host_arrays, host))
    strides = (weight.stride(0), host.stride(0), _moments_stride(slot_arrays), _moments_stride(host_arrays))
    beta1, beta2 = betas
    hyper = (float(lr), float(eps), float(beta1), float(beta2), 1.0 - beta1, 1.0 - beta2)
    switches = dict(RULE=_RULE_IDS[rule], TWO_TIERS=host_weight is not None, CHUNK=_CHUNK, BLOCK=_block(dim))
    _backward_chunks_kernel[(num_chunks,)](
        *arrays, sorted_rows, order, bag_of_value, scale, grad, heads, tails, num_values, dim, *strides, grad.stride(0),
        *hyper, **switches,
    )  # fmt: skip
    _long_runs_kernel[(num_chunks,)](
        *arrays, sorted_rows, heads, tails, num_values, num_chunks, dim, *strides, *hyper, SPAN=_SPAN, **switches,
    )  # fmt: skip


def _state_names(rule: str) -> tuple[str, ...]:
    """The state arrays ``rule`` keeps (`_STATE_OF_RULE`); an unknown rule is an error."""
    names = _STATE_OF_RULE.get(rule)
    if names is None:
        raise ValueError(f"the Triton kernels apply {', '.join(_STATE_OF_RULE)}, not {rule!r}.")
    return names


def _state_arrays(names: tuple[str, ...], state: dict[str, Tensor] | None, needing: str) -> list[Tensor]:
    """The arrays ``names`` of ``state``, in that order; where some are missing, an error that
    says ``needing`` and names them."""
    state = state or {}
    if missing := [name for name in names if name not in state]:
        raise ValueError(f"{needing} {' and '.join(missing)}.")
    return [state[name] for name in names]


def _three(arrays: list[Tensor], filler: Tensor) -> list[Tensor]:
    """A rule's state arrays as the kernels' three state pointers (an unused one: ``filler``)."""
    return [*arrays, *[filler] * (3 - len(arrays))]


def _moments_stride(arrays: list[Tensor]) -> int:
    """The row stride of Adam's two moments (both alike); 1 for the other rules, which read none."""
    if len(arrays) < 2:
        return 1
    if arrays[0].stride(0) != arrays[1].stride(0):
        raise ValueError(f"Adam's exp_avg and exp_avg_sq must have one row stride, not {arrays[0].stride(0)} and {arrays[1].stride(0)}.")
    return arrays[0].stride(0)


def move_rows(slots_array: Tensor, host_array: Tensor, slots: Tensor, write_rows: Tensor, fill_rows: Tensor) -> None:
    """For each ``i``: where ``write_rows[i] >= 0``, slot ``slots[i]`` of ``slots_array`` is
    written to that row of ``host_array``; then, where ``fill_rows[i] >= 0``, that host row is
    copied into the slot. One launch, eight slots a program; ``-1`` skips (a fixed-size input
    with its counts on the device). The slots must be distinct, and no row both written and
    filled."""
    width = slots_array.shape[1] if slots_array.dim() > 1 else 1
    if slots.numel() == 0 or width == 0:  # nothing to move (a directory of rows of no width: hit rates alone)
        return
    _move_rows_kernel[(triton.cdiv(slots.numel(), _PER_PROGRAM),)](
        slots_array, host_array, slots, write_rows, fill_rows, slots.numel(), width,
        slots_array.stride(0), host_array.stride(0), ROWS=_PER_PROGRAM, BLOCK=_block(width),
    )  # fmt: skip


class TritonTableBatchedEmbedding(torch.nn.Module):
    """A stack of tables of one width as one ``weight``, looked up with `pooled` and trained in
    its backward with `backward_step` (no gradient reaches ``weight``: the rule is applied to
    the rows read, as FBGEMM's fused TBE does). The rule's state is a buffer per array, a row per
    table row (``momentum``; ``exp_avg``, ``exp_avg_sq``, ``step``).

    Args:
        weight: the stack, ``(rows, dim)``, float32, on a CUDA device (or the CPU under
            ``TRITON_INTERPRET=1``).
        rule, lr, eps, betas: the row-wise rule (``sgd``, ``rowwise_adagrad`` or ``adam``).
    """

    def __init__(self, weight: Tensor, rule: str, lr: float, eps: float, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        super().__init__()
        names = _state_names(rule)
        why = why_unavailable(weight.device)
        if why is not None:
            raise RuntimeError(f"kernel='triton' cannot run here: {why}.")
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        rows, dim = weight.shape
        for name in names:
            width = dim if name.startswith("exp_avg") else 1
            self.register_buffer(name, torch.zeros(rows, width, dtype=torch.float32, device=weight.device))
        self.rule, self.lr, self.eps, self.betas = rule, lr, eps, betas
        self._anchor = torch.zeros((), requires_grad=True, device=weight.device)  # lets autograd reach the backward

    def state(self) -> dict[str, Tensor]:
        """The rule's state arrays by name."""
        return {name: getattr(self, name) for name in _STATE_OF_RULE[self.rule]}

    def forward(self, indices: Tensor, offsets: Tensor, bag_mean: Tensor | None = None, per_sample_weights: Tensor | None = None) -> Tensor:
        if not torch.is_grad_enabled():
            return pooled(self.weight, indices, offsets, bag_mean, per_sample_weights)
        return _LookupAndStep.apply(self._anchor, self, indices, offsets, bag_mean, per_sample_weights)


class _LookupAndStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: Tensor, tbe: TritonTableBatchedEmbedding, indices: Tensor, offsets: Tensor,  # type: ignore[override]
                bag_mean: Tensor | None, per_sample_weights: Tensor | None) -> Tensor:  # fmt: skip
        ctx.tbe, ctx.inputs = tbe, (indices, offsets, bag_mean, per_sample_weights)
        return pooled(tbe.weight, indices, offsets, bag_mean, per_sample_weights)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, ...]:  # type: ignore[override]
        tbe = ctx.tbe
        indices, offsets, bag_mean, per_sample_weights = ctx.inputs
        with torch.no_grad():
            backward_step(tbe.weight, grad, indices, offsets, tbe.rule, tbe.lr, tbe.eps, tbe.state(), bag_mean, per_sample_weights,
                          betas=tbe.betas)  # fmt: skip
        return (None,) * 6
