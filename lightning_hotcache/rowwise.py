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

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal

import torch
from torch import Tensor

from lightning_hotcache.host_rows import put_rows
from lightning_hotcache.sorting import sum_by_index, sum_rows_by_index

RowWiseOptimizerName = Literal["sgd", "rowwise_adagrad", "adam"]
# ``eps`` when none is given: the default of the optimizer each rule claims to be, so "the same
# rule" holds without setting it: TorchRec's RowWiseAdagrad (1e-10) and torch.optim.Adam (1e-8).
# SGD reads no eps; it gets Adagrad's so every config carries a valid one.
DEFAULT_EPS: dict[str, float] = {"sgd": 1e-10, "rowwise_adagrad": 1e-10, "adam": 1e-8}
# Checkpoint key of the row-wise optimizer state: {"<module path>.<table>": {state name: (rows, width)}}.
# One format for every strategy, so training resumes under another strategy than it started.
ROW_STATE_KEY = "embedding_row_state"
ROWWISE_OPTIMIZERS: tuple[str, ...] = ("sgd", "rowwise_adagrad", "adam")


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
    gives it without coalescing the COO tensor (see `lightning_hotcache.sorting`).
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
    inverse: Tensor,
    value_grads: Tensor,
    segment: Tensor | None = None,
) -> None:
    """One step of ``config`` for the distinct ``rows`` of ``table`` a batch read, from the
    gradient row of every value it read (``inverse``: the distinct row of each, numbered in
    ascending order). Staging knows the distinct rows, so summing duplicates is one
    ``index_add_``, no sort; SGD, being linear, scatters the value rows straight into the
    table, as `apply_sparse_update` does. With ``segment`` (see `TableReads`) ``rows`` has
    repeats, each stepped from its distinct row's sum: they write the same values."""
    if config.name == "sgd" and segment is None:
        table.index_add_(0, rows.index_select(0, inverse), value_grads.to(table.dtype), alpha=-config.lr)
        return
    summed = torch.zeros(len(rows), value_grads.shape[1], dtype=torch.float32, device=value_grads.device)
    summed.index_add_(0, inverse, value_grads.to(torch.float32))
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


@torch.no_grad()
def step_rows_of_tables(config: RowWiseOptimizerConfig, steps: list[tuple[Tensor, dict[str, Tensor], Tensor, Tensor]]) -> None:
    """`step_rows` for several tables of one width, each ``(table, state, rows, grads)``: their
    rows gathered end to end and stepped by one `update_rows`, so that the rule's kernels are
    launched once, not once per table (26 tables' row-wise Adagrad: 6 kernels, not 156). The
    rule works row by row, so each row gets what `step_rows` gives it."""
    if len(steps) == 1:
        step_rows(config, *steps[0])
        return
    weights = torch.cat([table.index_select(0, rows) for table, _, rows, _ in steps])
    row_state = {key: torch.cat([state[key].index_select(0, rows) for _, state, rows, _ in steps]) for key in steps[0][1]}
    config.update_rows(weights, row_state, torch.cat([grads for *_, grads in steps]).to(weights.dtype))
    start = 0
    for table, state, rows, _ in steps:
        stop = start + len(rows)
        put_rows(table, rows, weights[start:stop])
        for key, value in row_state.items():
            put_rows(state[key], rows, value[start:stop])
        start = stop


class RowWiseOptimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` applying a `RowWiseOptimizerConfig` to embedding weights.

    Needs sparse gradients (``nn.EmbeddingBag(sparse=True)``; see `use_sparse_gradients`):
    a dense gradient cannot tell a row that was looked up with zero gradient from one that
    was not looked up, and the two differ for Adam. Zeroes (drops) the gradients it used, so
    a dense optimizer that sees the same parameters afterwards skips them.
    """

    def __init__(self, params: Iterable[Tensor], config: RowWiseOptimizerConfig | None = None) -> None:
        self.config = config or RowWiseOptimizerConfig()
        super().__init__(params, defaults={})

    def _row_state(self, param: Tensor) -> dict[str, Tensor]:
        state = self.state[param]
        if not state:
            for key, width in self.config.state_widths(param.shape[1]).items():
                state[key] = torch.zeros(param.shape[0], width, dtype=torch.float32, device=param.device)
        for key, value in state.items():
            # A checkpoint may restore state on another device than the table it belongs to.
            if value.device != param.device:
                state[key] = value.to(param.device)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
        # SGD scatter-adds repeats itself, and a coalesced gradient (sparse_ddp's) is summed already.
        summed_here = [self.config.name != "sgd" and not g.is_coalesced() for _, g in taken]
        to_sum = [pair for pair, here in zip(taken, summed_here) if here]
        if to_sum:
            # The rows of all tables of one width summed with one sort (not one per table).
            summed = sum_rows_by_index(
                [g._indices()[0] for _, g in to_sum], [g._values() for _, g in to_sum], [len(p) for p, _ in to_sum]
            )
            by_width: dict[int, list[tuple[Tensor, dict[str, Tensor], Tensor, Tensor]]] = {}
            for (param, _), (rows, grads) in zip(to_sum, summed):
                by_width.setdefault(param.shape[1], []).append((param, self._row_state(param), rows, grads))
            for steps in by_width.values():
                step_rows_of_tables(self.config, steps)
        for (param, grad), here in zip(taken, summed_here):
            if not here:
                apply_sparse_update(self.config, param, self._row_state(param), grad)
        return loss


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
