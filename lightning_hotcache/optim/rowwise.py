"""Row-wise embedding optimizers: the one update rule every strategy applies to embedding rows.

Embedding tables are trained the way TorchRec trains them: only the rows a batch looked up
are updated, duplicate ids are summed first, and the optimizer state is per row, so it can
live next to its row in any memory tier. The rule is written once (`RowWiseOptimizerConfig.
update_rows`, on gathered rows) and used by the plain path (`RowWiseOptimizer`, a
torch.optim.Optimizer over sparse gradients, usable with TorchRec's
`apply_optimizer_in_backward`) and by the hot/cold cache, so all paths learn the same thing.

Written here rather than taken from a library because none does all three on CPU and GPU
alike: torch.optim has no row-wise Adagrad and its sparse Adam keeps one step count per
tensor (state could not travel with a row), and FBGEMM's fused kernels keep their state
inside the table-batched module (and have no CPU Adam).
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Sequence

import torch
from torch import Tensor
from typing_extensions import override

from lightning_hotcache._compat import add_to_each
from lightning_hotcache._ops.host_rows import put_rows
from lightning_hotcache._ops.sorting import sort_with_repeats, split_stack_rows, sum_by_index
from lightning_hotcache.kernels import triton_tbe
from lightning_hotcache.optim.stacked_tables import stacked_rows

RowWiseOptimizerName = Literal["sgd", "rowwise_adagrad", "adam"]
# ``eps`` when none is given: the default of the optimizer each rule claims to be, so "the same
# rule" holds without setting it: TorchRec's RowWiseAdagrad (1e-10) and torch.optim.Adam (1e-8).
# SGD reads no eps; it gets Adagrad's so every config carries a valid one.
DEFAULT_EPS: dict[str, float] = {"sgd": 1e-10, "rowwise_adagrad": 1e-10, "adam": 1e-8}
# Checkpoint key of the row-wise optimizer state: {"<module path>.<table>": {state name: (rows, width)}}.
# One format for every strategy, so training resumes under another strategy than it started.
ROW_STATE_KEY = "embedding_row_state"
ROWWISE_OPTIMIZERS: tuple[str, ...] = ("sgd", "rowwise_adagrad", "adam")
# Devices where a row step sorts its rows with repeats kept rather than sizing the distinct ones,
# which would make the host wait (`RowWiseOptimizer._step_width`, hotcache's `SummingUpdate`).
SORTS_WITH_REPEATS_ON = frozenset({"cuda"})
# Gradient rows of tables of one width: each one's row (repeats allowed), and the rows themselves.
GradientRows = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class PooledGradients:
    """A lookup's gradient as its bags' (`RowWiseOptimizer.add_pooled_gradients`)."""

    tables: tuple[Tensor, ...]
    rows: Tensor  # each id's row in the tables laid end to end
    offsets: Tensor  # the bags' cuts of ``rows``
    grad: Tensor  # each bag's gradient row
    bag_mean: Tensor | None  # per bag: averaged (1) or summed (0); None: all summed
    per_sample_weights: Tensor | None

    def as_rows(self) -> tuple[tuple[Tensor, ...], Tensor, Tensor]:
        """The same gradient as each id's gradient row (`RowWiseOptimizer.add_row_gradients`)."""
        bag_of_value, scale = triton_tbe.value_scales(self.offsets, self.rows.numel(), self.bag_mean, self.per_sample_weights)
        return self.tables, self.rows, self.grad.index_select(0, bag_of_value).mul_(scale.unsqueeze(1))


@dataclass(frozen=True)
class RowWiseOptimizerConfig:
    """Which row-wise rule trains the embedding tables, and its hyperparameters.

    Args:
        name: ``sgd``; ``rowwise_adagrad`` (FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator
            per row, ``acc += mean(g**2)``, ``w -= lr * g / (sqrt(acc) + eps)``); or ``adam``
            (lazy Adam: per-element moments updated only for rows looked up, bias correction
            by the number of updates that row has had).
        lr: learning rate.
        eps: added to the denominator (Adagrad, Adam). ``None`` (the default) takes the
            default of the optimizer the rule matches: 1e-10 for ``rowwise_adagrad`` (TorchRec's
            ``RowWiseAdagrad``), 1e-8 for ``adam`` (``torch.optim.Adam``); SGD has none.
        beta1: Adam's first-moment decay.
        beta2: Adam's second-moment decay.
    """

    name: RowWiseOptimizerName = "rowwise_adagrad"
    lr: float = 0.05
    eps: float | None = None
    beta1: float = 0.9
    beta2: float = 0.999

    def __post_init__(self) -> None:
        if self.name not in ROWWISE_OPTIMIZERS:
            raise ValueError(
                f"Unknown row-wise optimizer {self.name!r}; choose one of {', '.join(ROWWISE_OPTIMIZERS)}."
            )
        eps = DEFAULT_EPS[self.name] if self.eps is None else self.eps
        object.__setattr__(self, "eps", eps)  # frozen: resolved once, here
        if not self.lr > 0:
            raise ValueError(f"Row-wise optimizer lr must be > 0, got {self.lr}.")
        if not eps > 0:
            raise ValueError(f"Row-wise optimizer eps must be > 0, got {eps}.")
        for beta_name in ("beta1", "beta2"):
            beta = getattr(self, beta_name)
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Row-wise optimizer {beta_name} must be in [0, 1), got {beta}.")

    def state_widths(self, embedding_dim: int) -> dict[str, int]:
        """Per-row optimizer state: name -> number of float32 values per row."""
        if self.name == "sgd":
            return {}
        if self.name == "rowwise_adagrad":
            return {"momentum": 1}
        return {"exp_avg": embedding_dim, "exp_avg_sq": embedding_dim, "step": 1}

    def check_saved_state(self, table: str, saved: Iterable[str]) -> None:
        """A clear error where a checkpoint's row-wise state of ``table`` (its arrays' names) is
        not what this rule keeps: it was saved with another embedding optimizer, and resuming
        would fail on a missing array, or restart the rule's state in silence."""
        kept = sorted(self.state_widths(1))
        if sorted(saved) != kept:
            raise ValueError(
                f"Table {table!r}: the checkpoint's row-wise optimizer state has {sorted(saved) or 'no arrays'}, but "
                f"this model's {self.name} keeps {kept or 'none'}: it was saved with another embedding optimizer. "
                "Resume with the embedding optimizer it was saved with, or start a new run from its weights alone "
                "(its state_dict)."
            )

    def update_rows(self, weights: Tensor, state: dict[str, Tensor], grads: Tensor) -> None:
        """Apply one step in place to gathered rows.

        ``weights`` and ``grads`` are (rows, dim) with one row per *unique* id (duplicates
        already summed); ``state`` holds the same rows of each state tensor, (rows, width).
        """
        if self.name == "sgd":
            weights.add_(grads, alpha=-self.lr)
        elif self.name == "rowwise_adagrad":
            momentum = state["momentum"]
            momentum.add_(grads.square().mean(dim=1, keepdim=True))
            weights.addcdiv_(grads, momentum.sqrt().add_(self.eps), value=-self.lr)
        else:
            step = state["step"].add_(1.0)
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.lerp_(grads, 1.0 - self.beta1)
            exp_avg_sq.mul_(self.beta2).addcmul_(grads, grads, value=1.0 - self.beta2)
            bias_correction1 = 1.0 - torch.pow(self.beta1, step)
            bias_correction2 = 1.0 - torch.pow(self.beta2, step)
            denom = (exp_avg_sq / bias_correction2).sqrt_().add_(self.eps)
            weights.addcdiv_(exp_avg / bias_correction1, denom, value=-self.lr)


@torch.no_grad()
def apply_sparse_update(
    config: RowWiseOptimizerConfig, table: Tensor, state: dict[str, Tensor], grad: Tensor
) -> Tensor:
    """One step of ``config`` on ``table`` (and its per-row ``state``) from a sparse row
    gradient; returns the rows it touched (possibly repeated).

    SGD is linear, so it scatter-adds the uncoalesced gradient (duplicates sum on the way)
    and skips the sort. The other rules need each row's summed gradient: `sum_by_index`
    gives it without coalescing the COO tensor (see `lightning_hotcache._ops.sorting`).
    """
    rows, values = grad._indices()[0], grad._values()  # uncoalesced COO: .indices() insists on coalescing
    if config.name == "sgd":
        table.index_add_(0, rows, values.to(table.dtype), alpha=-config.lr)
        return rows
    if not grad.is_coalesced():
        rows, values = sum_by_index(rows, values)
    step_rows(config, table, state, rows, values)
    return rows


@torch.no_grad()
def step_read_rows(
    config: RowWiseOptimizerConfig,
    table: Tensor,
    state: dict[str, Tensor],
    rows: Tensor,
    summed: Tensor,
    segment: Tensor | None = None,
) -> None:
    """One step of ``config`` for the distinct ``rows`` of ``table`` a batch read, from their
    ``summed`` gradient rows (`sorting.sum_bag_rows`: staging knows the distinct rows, so
    summing duplicates needs no sort). SGD too: adding every value's row straight into the
    table (a large one, at random rows) scatters into it once per value rather than once per
    distinct row, which made a CPU's embedding step markedly longer (benchmarks/README.md).
    With ``segment`` (see `TableReads`) ``rows`` has repeats, each stepped from its distinct
    row's sum: they write the same values."""
    step_rows(config, table, state, rows, summed if segment is None else summed.index_select(0, segment))


@torch.no_grad()
def step_rows(config: RowWiseOptimizerConfig, table: Tensor, state: dict[str, Tensor], rows: Tensor, grads: Tensor) -> None:
    """One step of ``config`` on the distinct ``rows`` of ``table`` (and of its per-row
    ``state``), ``grads`` being their summed gradient rows: gather, step, scatter."""
    weights = table.index_select(0, rows)
    row_state = {key: value.index_select(0, rows) for key, value in state.items()}
    config.update_rows(weights, row_state, grads.to(weights.dtype))
    put_rows(table, rows, weights)
    for key, value in row_state.items():
        put_rows(state[key], rows, value)


class _StateStack:
    """The per-row state of an optimizer's tables of one width (on one device), end to end:
    each table's state (``optimizer.state[table]``) is a view of its rows here, so a step
    gathers and writes each state array once for all the tables, not once per table (26
    tables' lazy Adam: 6 ops, not 156). State put in the optimizer's dict from elsewhere
    (a checkpoint, ``load_state_dict``) is copied in at the next step."""

    def __init__(self, tables: list[Tensor], widths: dict[str, int], state: dict[Tensor, dict[str, Tensor]]) -> None:
        self.tables = tables
        self.first_row = dict(zip(tables, itertools.accumulate((len(t) for t in tables), initial=0)))
        self.num_rows, device = sum(len(t) for t in tables), tables[0].device
        self.arrays = {key: torch.zeros(self.num_rows, width, dtype=torch.float32, device=device) for key, width in widths.items()}
        self._views = {table: self._rows_of(table) for table in tables}
        self.adopt(state)

    def rows_of_tables(self, tables: Sequence[Tensor], rows: Tensor) -> Tensor:
        """Rows ``rows`` of ``tables`` laid end to end (`RowWiseOptimizer.add_row_gradients`) as
        rows of this stack."""
        first = self.first_row[tables[0]]
        if all(self.first_row[b] == self.first_row[a] + a.shape[0] for a, b in itertools.pairwise(tables)):
            return rows + first if first else rows  # the zoo's: a collection's tables in its order
        starts = list(itertools.accumulate((t.shape[0] for t in tables), initial=0))
        ends = torch.tensor(starts[1:], device=rows.device)
        shifts = torch.tensor([self.first_row[t] - start for t, start in zip(tables, starts)], device=rows.device)
        return rows + shifts[torch.searchsorted(ends, rows, right=True)]

    def _rows_of(self, table: Tensor) -> dict[str, Tensor]:
        first = self.first_row[table]
        return {key: array[first : first + len(table)] for key, array in self.arrays.items()}

    def adopt(self, state: dict[Tensor, dict[str, Tensor]]) -> None:
        """Make every table's state the view of its rows here, copying in any other tensor found there."""
        for table, views in self._views.items():
            found = state[table]
            for key, view in views.items():
                if found.get(key) is not view:
                    if key in found:
                        if found[key].shape != view.shape:
                            raise ValueError(
                                f"Row state {key!r} of an embedding table of shape {tuple(table.shape)} has shape "
                                f"{tuple(found[key].shape)}, not {tuple(view.shape)}: the state restored (a checkpoint's "
                                "embedding_row_state?) belongs to another table or another row-wise optimizer."
                            )
                        view.copy_(found[key])  # also from another device: a checkpoint may be restored anywhere
                    found[key] = view


class RowWiseOptimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` applying a `RowWiseOptimizerConfig` to embedding weights.

    Steps the tables' sparse gradients (``nn.EmbeddingBag(sparse=True)``; see
    `use_sparse_gradients`): a dense gradient cannot tell a row that was looked up with zero
    gradient from one that was not looked up, and the two differ for Adam. Zeroes (drops) the
    gradients it used, so a dense optimizer that sees the same parameters afterwards skips
    them. A lookup that has every table's gradient rows in one tensor may hand them over as
    one piece instead (`add_row_gradients`), the tables then getting no ``.grad``.
    """

    def __init__(self, params: Iterable[Tensor], config: RowWiseOptimizerConfig | None = None) -> None:
        self.config = config or RowWiseOptimizerConfig()
        super().__init__(params, defaults={})
        self._stacks: dict[tuple[int, torch.device], _StateStack] = {}  # by width and device
        self._handed_over: list[tuple[tuple[Tensor, ...], Tensor, Tensor]] = []  # see add_row_gradients
        self._pooled: list[PooledGradients] = []  # see add_pooled_gradients

    def add_row_gradients(self, tables: Sequence[Tensor], rows: Tensor, grads: Tensor) -> None:
        """Take the sparse gradient of ``tables`` (of one width and device, all this optimizer's)
        as one piece, stepped by the next `step` with any ``.grad``: gradient row ``grads[k]``
        belongs to row ``rows[k]`` of the tables laid end to end (table ``j``'s row ``i`` is
        row ``len(tables[0]) + ... + len(tables[j - 1]) + i``), duplicates not summed, as in an
        uncoalesced sparse gradient.

        Why: a collection's lookup (`lightning_hotcache.embedding.torchrec_lookup`) finds all
        its tables' gradient rows in one gather; as ``.grad`` they become one sparse tensor and
        one autograd accumulation per table, then one piece each for this step to take apart
        and concatenate again: host time per table, on the path of a step that the host bounds.
        TorchRec's fused modules skip ``.grad`` the same way.
        """
        self._handed_over.append((tuple(tables), rows, grads))

    def add_pooled_gradients(
        self,
        tables: Sequence[Tensor],
        rows: Tensor,
        offsets: Tensor,
        grad: Tensor,
        bag_mean: Tensor | None,
        per_sample_weights: Tensor | None,
    ) -> None:
        """Take the gradient of ``tables`` as their bags' (``grad[k]`` for the ids
        ``rows[offsets[k]:offsets[k + 1]]``, rows of the tables laid end to end as in
        `add_row_gradients`). Where it is a step's only gradient of those tables, the tables
        are one stack in the state's order and no process reduces the rows, `step` applies
        the rule in Triton's kernel, one pass over the bags
        (`triton_tbe.backward_step`); otherwise it steps it as gradient rows."""
        self._pooled.append(PooledGradients(tuple(tables), rows, offsets, grad, bag_mean, per_sample_weights))

    def _step_in_triton(self, piece: PooledGradients, others: int) -> bool:
        """Step ``piece`` in Triton's kernel where it can (see `add_pooled_gradients`)."""
        if others:
            return False
        stack = self._stacks[_width(piece.tables[0])]
        weights = stacked_rows(stack.tables)
        if weights is None or stack.first_row[piece.tables[0]] != 0 or len(piece.tables) != len(stack.tables):
            return False
        config = self.config
        triton_tbe.backward_step(
            weights, piece.grad, piece.rows, piece.offsets, config.name, config.lr, config.eps, stack.arrays, piece.bag_mean,
            piece.per_sample_weights, betas=(config.beta1, config.beta2),
        )  # fmt: skip
        return True

    def state_tensors(self) -> list[Tensor]:
        """Every per-row state array this optimizer steps (those of the tables stepped so far)."""
        return [array for stack in self._stacks.values() for array in stack.arrays.values()]

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._handed_over, self._pooled = [], []  # gradients too, only not in ``.grad``
        super().zero_grad(set_to_none)

    def _state_stacks(self, params: Iterable[Tensor]) -> None:
        """Make the stacks holding the row state of ``params``'s widths and devices (on first
        use, for every table of the width and device; again if the tables moved), and bring each
        up to date with ``self.state`` once."""
        adopted: set[tuple[int, torch.device]] = set()
        for param in params:
            key = (param.shape[1], param.device)
            found = self._stacks.get(key)
            if found is None or param not in found.first_row:
                tables = [p for group in self.param_groups for p in group["params"] if (p.shape[1], p.device) == key]
                if not any(table is param for table in tables):
                    raise ValueError(
                        f"A gradient was handed to RowWiseOptimizer for a {tuple(param.shape)} table that is not one of "
                        "its parameters: build the optimizer over every table the lookup steps."
                    )
                found = _StateStack(tables, self.config.state_widths(param.shape[1]), self.state)
                # A stack these tables left (moved to another device) holds nothing of theirs now.
                self._stacks = {k: old for k, old in self._stacks.items() if not old.first_row.keys() & found.first_row.keys()}
                self._stacks[key] = found
            elif key not in adopted:
                found.adopt(self.state)
            adopted.add(key)

    def _step_width(self, stack: _StateStack, keys: Tensor, grads: Tensor) -> None:
        """One step for the tables of ``stack`` from gradient rows ``grads`` at the stack's rows
        ``keys`` (not summed): the rows summed and stepped by one sort and one `update_rows`
        over the stack, so that the rule's kernels are launched once, not once per table; the
        rule works row by row, so each row gets what `step_rows` gives it. Where the tables are
        themselves one stack of rows in the state's order (`stack_tables`), their rows are
        gathered and written with one op each, not one per table (and no per-table split,
        which reads the split points on the host). SGD is summed here too: adding every value's
        row straight into a large table at random rows writes it once per value, not once per
        distinct row, which lengthened the zoo's embedding step as it did hotcache's
        (`step_read_rows`; benchmarks/README.md)."""
        weight_stack = stacked_rows(stack.tables)
        if weight_stack is not None and keys.device.type in SORTS_WITH_REPEATS_ON:
            # The distinct rows' count (``unique``'s output size) would make the host wait for
            # the device: every key's row is stepped instead, sorted with repeats kept, each
            # repeat from its distinct row's sum (they write the same values), as hotcache's
            # PyTorch path does on CUDA (`embedding.batch.sorted_reads`).
            ordered, inverse, segment = sort_with_repeats(keys)
            summed = torch.zeros(len(keys), grads.shape[1], dtype=torch.float32, device=grads.device)
            summed.index_add_(0, inverse, grads.to(torch.float32))
            step_read_rows(self.config, weight_stack, stack.arrays, ordered, summed, segment)
            return
        rows, summed = sum_by_index(keys, grads, stack.num_rows)
        if weight_stack is not None:
            weights = weight_stack.index_select(0, rows)
        else:
            own_rows = split_stack_rows(rows, list(stack.first_row.values()), stack.num_rows)
            weights = torch.cat([table.index_select(0, r) for table, r in zip(stack.tables, own_rows)])
        row_state = {key: array.index_select(0, rows) for key, array in stack.arrays.items()}
        self.config.update_rows(weights, row_state, summed.to(weights.dtype))
        if weight_stack is not None:
            put_rows(weight_stack, rows, weights)
        else:
            for table, r, stepped in zip(stack.tables, own_rows, weights.split([len(r) for r in own_rows])):
                put_rows(table, r, stepped)
        for key, value in row_state.items():
            put_rows(stack.arrays[key], rows, value)

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], Any] | None = None,
        reduce_rows: Callable[[list[GradientRows]], list[GradientRows]] | None = None,
    ) -> Any:
        """One step from the tables' sparse ``.grad`` and the gradient rows handed over.

        ``reduce_rows`` (e.g. `sparse_ddp.average_row_gradients`, over processes) gets, for
        every width and device of this optimizer's tables in a fixed order (a width without
        gradient rows as an empty one), the rows' indices in the width's tables laid end to end
        in the param groups' order and their gradient rows, and returns what to step instead."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        taken = self._take_sparse_gradients()
        handed_over, self._handed_over = self._handed_over, []
        pooled, self._pooled = self._pooled, []
        if reduce_rows is None:
            self._state_stacks(
                itertools.chain((param for param, _ in taken), (t for tables, _, _ in handed_over for t in tables), (t for p in pooled for t in p.tables))
            )
            if pooled:  # each width's pieces: Triton steps a width's only one
                pieces = collections.Counter(
                    map(_width, itertools.chain((p for p, _ in taken), (ts[0] for ts, _, _ in handed_over), (p.tables[0] for p in pooled)))
                )
                handed_over += [piece.as_rows() for piece in pooled if not self._step_in_triton(piece, pieces[_width(piece.tables[0])] - 1)]
            summed = [grad.is_coalesced() for _, grad in taken]  # sparse_ddp's: each table's summed already
            for (param, grad), done in zip(taken, summed):
                if done:
                    apply_sparse_update(self.config, param, self.state[param], grad)
            taken = [pair for pair, done in zip(taken, summed) if not done]
        else:  # every width, so that every process reduces the same ones
            self._state_stacks(p for group in self.param_groups for p in group["params"])
            handed_over += [piece.as_rows() for piece in pooled]
        by_width = self._rows_by_width(taken, handed_over)
        if reduce_rows is not None:
            widths = list(dict.fromkeys((p.shape[1], p.device) for group in self.param_groups for p in group["params"]))
            reduced = reduce_rows([_joined(*by_width.get(key, ([], [])), width=key[0], device=key[1]) for key in widths])
            joined = {key: (rows, grads) for key, (rows, grads) in zip(widths, reduced) if len(rows)}
        else:
            joined = {key: _joined(rows, grads, width=key[0], device=key[1]) for key, (rows, grads) in by_width.items()}
        for key, (rows, grads) in joined.items():
            self._step_width(self._stacks[key], rows, grads)
        return loss

    def _take_sparse_gradients(self) -> list[tuple[Tensor, Tensor]]:
        """The tables' sparse ``.grad`` (each table with one), taken: ``.grad`` is None after."""
        taken: list[tuple[Tensor, Tensor]] = []
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if not param.grad.is_sparse:
                    raise RuntimeError(
                        "RowWiseOptimizer needs sparse embedding gradients; build the tables with "
                        "nn.EmbeddingBag(sparse=True) (lightning_hotcache.use_sparse_gradients(module))."
                    )
                taken.append((param, param.grad))
                param.grad = None
        return taken

    def _rows_by_width(
        self, taken: list[tuple[Tensor, Tensor]], handed_over: list[tuple[tuple[Tensor, ...], Tensor, Tensor]]
    ) -> dict[tuple[int, torch.device], tuple[list[Tensor], list[Tensor]]]:
        """Per width and device: the gradient rows of ``taken`` (sparse gradients, not summed)
        and ``handed_over``, each piece as (its rows in the width's state stack, gradient rows),
        in that order (per table, the order of the param groups: the stack's)."""
        by_width: dict[tuple[int, torch.device], tuple[list[Tensor], list[Tensor]]] = {}
        grouped: dict[tuple[int, torch.device], list[tuple[Tensor, Tensor]]] = {}
        for param, grad in taken:
            grouped.setdefault((param.shape[1], param.device), []).append((param, grad))
        for key, pairs in grouped.items():
            first_rows = [self._stacks[key].first_row[param] for param, _ in pairs]
            rows = add_to_each([grad._indices()[0] for _, grad in pairs], first_rows)  # one op, not one per table
            by_width[key] = (rows, [grad._values() for _, grad in pairs])
        for tables, rows, grads in handed_over:
            key = (tables[0].shape[1], tables[0].device)
            stack_rows, values = by_width.setdefault(key, ([], []))
            stack_rows.append(self._stacks[key].rows_of_tables(tables, rows))
            values.append(grads)
        return by_width


def _width(table: Tensor) -> tuple[int, torch.device]:
    return table.shape[1], table.device


def _joined(rows: list[Tensor], grads: list[Tensor], width: int, device: torch.device) -> GradientRows:
    """Pieces of gradient rows as one (an empty one of ``width`` where there are none; a lone
    piece as it is, not copied)."""
    if not rows:
        return torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, width, device=device)
    if len(rows) == 1:
        return rows[0], grads[0]
    return torch.cat(rows), torch.cat(grads)


def use_sparse_gradients(module: torch.nn.Module) -> list[Tensor]:
    """Switch every ``nn.EmbeddingBag`` under ``module`` to sparse gradients; return their weights.

    torchrec's unsharded EmbeddingBagCollection builds dense-gradient bags: every step would
    then materialize a gradient the size of the whole table.
    """
    weights = []
    for bag in module.modules():
        if isinstance(bag, torch.nn.EmbeddingBag):
            bag.sparse = True
            weights.append(bag.weight)
    return weights
