"""One CUDA graph a training step: a step function captured once and replayed for every batch
of the same shapes.

A step bound by its host (one launch from Python per op, a few hundred a step) runs at the
chip's pace once all its launches are one graph replay. `StepGraph` holds a step function
``step(batch) -> outputs`` (the forward, loss, backward and any in-place update: what a step
does before its dense optimizer) and decides, batch by batch, how it runs:

* **eagerly** (`StepGraph.run` returns None: the caller runs its ordinary step) while the batch's
  shapes have not repeated for ``warmup`` steps in a row: the first steps of a fit, an epoch's
  short last batch, multi-hot batches whose lengths change every step;
* **captured**, on the ``warmup``-th batch in a row of one shape: the step function runs on
  static copies of that batch's tensors and is recorded; the recording's first replay is that
  batch's step; a graph of other shapes is dropped (one graph is kept);
* **replayed**, for every later batch of the captured shapes: its tensors are copied into the
  static copies and the graph replays.

A capture the step refuses (a host read of a device value, a CUDA op that cannot be recorded)
changes nothing the step writes, and the fit steps eagerly from then on; `StepGraph.eager_reason`
says why. What a batch is, and how its static copy is made and refilled, is `BatchLayout`'s.

Written by hand: ``torch.cuda.make_graphed_callables`` graphs a module's forward and backward
but not what a step does after them (the row-wise update, here in the graph), and Lightning has
no graph support of its own. `StandInGraphs` runs the same logic on a CPU for tests: its
"replay" runs the step function again on the static copies, refuses the host reads a capture
refuses and checks that every replay runs the captured ops at the captured shapes.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import traceback
from pathlib import Path
from typing import Any, Callable, Generic, Iterator, Protocol, Sequence, TypeVar

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

Batch = TypeVar("Batch")
StepFn = Callable[[Any], Any]

# How many batches of one shape in a row before the step is captured: the first steps allocate
# what every later step reuses (the optimizer's state, cached index tensors, cuBLAS workspaces),
# which a capture must find in place.
WARMUP_STEPS = 3


_RECORDING = contextvars.ContextVar("step_graph_recording", default=False)


def recording() -> bool:
    """Whether the caller runs inside a step a `StepGraph` records (or, with `StandInGraphs`,
    replays): its batch is then a static copy of the one handed to `StepGraph.run`, and what
    its Python does is not done again at a CUDA replay."""
    return _RECORDING.get()


@contextlib.contextmanager
def _recorded() -> Iterator[None]:
    token = _RECORDING.set(True)
    try:
        yield
    finally:
        _RECORDING.reset(token)


class BatchLayout(Protocol[Batch]):
    """What `StepGraph` needs to know of a batch type."""

    def signature(self, batch: Batch) -> Any:
        """A hashable value equal for two batches exactly when one graph serves both: every
        tensor's shape, dtype and device and any host value the step reads (e.g. a jagged
        tensor's lengths per key)."""

    def static_copy(self, batch: Batch) -> Batch:
        """A batch of the same signature whose tensors are new memory, holding ``batch``'s values."""

    def refill(self, static: Batch, batch: Batch) -> None:
        """Copy ``batch``'s tensors into ``static``'s (same signature)."""


class Graphs(Protocol):
    """Where graphs are recorded and replayed (`CudaGraphs`; `StandInGraphs` on a CPU)."""

    def capture(self, step: Callable[[], Any], touched: Callable[[], Sequence[Tensor]]) -> tuple[Any, Any]:
        """Record ``step`` and run it once; returns (the graph, its outputs). On any error nothing
        in ``touched()`` (what the step writes) has changed."""

    def replay(self, graph: Any) -> None:
        """Run ``graph`` again."""


class CudaGraphs:
    """CUDA's graphs: ``torch.cuda.CUDAGraph`` recorded on a side stream, in a memory pool of
    their own; the recording's first replay is the captured batch's step."""

    def capture(self, step: Callable[[], Any], touched: Callable[[], Sequence[Tensor]]) -> tuple[Any, Any]:
        graph = torch.cuda.CUDAGraph()
        # Recording launches nothing, so a capture that fails has written nothing. Thread-local:
        # the loader's pinning thread (and hotcache's staging threads) may call CUDA meanwhile.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outputs = step()
        graph.replay()
        return graph, outputs

    def replay(self, graph: Any) -> None:
        graph.replay()


class HostReadInGraph(RuntimeError):
    """A graphed step read a device value on the host, or changed its ops or shapes."""


# Ops whose result the host must learn, which a CUDA capture refuses: a tensor's value as a
# number, and outputs whose size depends on the values.
_HOST_READS = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::is_nonzero",
        "aten::item",
        "aten::nonzero",
        "aten::masked_select",
        "aten::unique_consecutive",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::equal",
    }
)

# A tensor made of a host value inside the step (a literal, or a Python value written by indexing,
# which torch makes a tensor first), then written into another: on CUDA a copy from pageable host
# memory, which waits for the device and which a capture refuses; on a CPU it looks like any other
# op. The ops that write a value, and where it is among their arguments.
_HOST_VALUE = "aten::lift_fresh"
_WRITTEN_VALUE = {"aten::index_put_": 2, "aten::index_put": 2, "aten::_index_put_impl_": 2, "aten::copy_": 1}


class _OpTrace(TorchDispatchMode):
    """Records each op run and its outputs' shapes; refuses the ops of `_HOST_READS`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[tuple[int, ...], ...]]] = []
        self._host_values: list[Tensor] = []  # tensors of host values made in the step

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        if name in _HOST_READS:
            raise HostReadInGraph(
                f"the graphed step calls {name}, which reads a device value on the host: a CUDA graph cannot record it."
            )
        written = _WRITTEN_VALUE.get(name)
        if written is not None and len(args) > written and any(args[written] is t for t in self._host_values):
            raise HostReadInGraph(
                f"the graphed step writes a host value into a tensor ({name}: a Python value written by indexing, as in "
                "`t[i] = 0`, or a torch.tensor made in the step; use fill_, index_fill_ or masked_fill_): on CUDA that "
                "copies it from the host, which a CUDA graph cannot record."
            )
        out = func(*args, **(kwargs or {}))
        if name == _HOST_VALUE:
            self._host_values.append(out)
        shapes = tuple(tuple(t.shape) for t in _tensors(out))
        self.ops.append((name, shapes))
        return out


def _tensors(outputs: Any) -> list[Tensor]:
    return [t for t in (outputs if isinstance(outputs, (tuple, list)) else (outputs,)) if isinstance(t, Tensor)]


class StandInGraphs:
    """A CPU stand-in for `CudaGraphs`, for tests of what is around the graphs: "replaying" runs
    the step function again (on the static copies, which only a refill changes), under a trace
    that refuses host reads and requires the captured ops and shapes, as a recording would.
    A refused capture puts back what it wrote."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def capture(self, step: Callable[[], Any], touched: Callable[[], Sequence[Tensor]]) -> tuple[Any, Any]:
        saved = [t.detach().clone() for t in touched()]
        trace = _OpTrace()
        try:
            with trace:
                outputs = step()
        except BaseException:
            with torch.no_grad():
                for tensor, value in zip(touched(), saved):
                    tensor.copy_(value)
            raise
        self.captures += 1
        return (step, trace.ops, outputs), outputs

    def replay(self, graph: Any) -> None:
        step, captured, outputs = graph
        trace = _OpTrace()
        with trace:
            again = step()
        # A recording writes its outputs where the capture's were: the caller holds those.
        for static, value in zip(_tensors(outputs), _tensors(again)):
            static.copy_(value)
        if trace.ops != captured:
            first = next((k for k, (a, b) in enumerate(zip(trace.ops, captured)) if a != b), min(len(trace.ops), len(captured)))
            raise HostReadInGraph(
                f"the graphed step ran other ops or shapes than it was captured with (op {first}: "
                f"{trace.ops[first] if first < len(trace.ops) else 'none'} against "
                f"{captured[first] if first < len(captured) else 'none'}): a CUDA graph would replay stale ones."
            )
        self.replays += 1


class StepGraph(Generic[Batch]):
    """The graph of one step function over batches of one layout (see the module's docstring).

    Args:
        step: runs one training step on a batch (forward, backward, in-place updates) and
            returns its outputs (tensors the caller reads after the step, e.g. the loss).
        layout: the batches' `BatchLayout`.
        graphs: `CudaGraphs` on a GPU, `StandInGraphs` in tests.
        touched: the tensors the step writes (parameters, optimizer state), for `Graphs.capture`.
        warmup: batches of one shape in a row before it is captured.
    """

    def __init__(
        self,
        step: StepFn,
        layout: BatchLayout[Batch],
        graphs: Graphs,
        touched: Callable[[], Sequence[Tensor]],
        warmup: int = WARMUP_STEPS,
    ) -> None:
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 step, got {warmup}.")
        self.step, self.layout, self.graphs, self.touched, self.warmup = step, layout, graphs, touched, warmup
        self.eager_reason: str | None = None  # set once a capture was refused: no more graphs then
        self._graph: Any = None
        self._signature: Any = None  # the graph's
        self._static: Batch | None = None
        self._outputs: Any = None
        self._seen: Any = None  # the last batch's signature and how many in a row had it
        self._in_a_row = 0
        self.captures = 0
        self.replays = 0
        self.eager_steps = 0

    def run(self, batch: Batch) -> Any:
        """Step ``batch`` in the graph (capturing it first where its shapes have repeated
        ``warmup`` times); returns the step's outputs (the graph's static ones: read them before
        the next call), or None where the caller must step ``batch`` eagerly itself."""
        if self.eager_reason is not None:
            self.eager_steps += 1
            return None
        signature = self.layout.signature(batch)
        self._in_a_row = self._in_a_row + 1 if signature == self._seen else 1
        self._seen = signature
        if self._graph is not None and signature == self._signature:
            self.layout.refill(self._static, batch)
            with _recorded():
                self.graphs.replay(self._graph)
            self.replays += 1
            return self._outputs
        if self._in_a_row < self.warmup:
            self.eager_steps += 1
            return None
        return self._capture(signature, batch)

    def _capture(self, signature: Any, batch: Batch) -> Any:
        self._graph = self._static = self._outputs = None  # one graph: the old one's memory goes
        static = self.layout.static_copy(batch)
        try:
            with _recorded():
                graph, outputs = self.graphs.capture(lambda: self.step(static), self.touched)
        except Exception as error:  # noqa: BLE001 - any refusal: the caller steps eagerly, and says why
            self.eager_reason = refusal_reason(error)
            self.eager_steps += 1
            return None
        self._graph, self._signature, self._static, self._outputs = graph, signature, static, outputs
        self.captures += 1
        return outputs


def refusal_reason(error: BaseException) -> str:
    """What refused a capture, in one line: the first error raised (a CUDA capture that fails
    inside raises again as it ends, "operation failed due to a previous error during capture",
    with the first as its context) and where in this project's code, outside this module's
    stand-in, it was raised."""
    first = error
    while first.__context__ is not None:
        first = first.__context__
    message = str(first).splitlines()[0] if str(first) else ""
    reason = f"{type(first).__name__}: {message}".rstrip(": ")
    frames = traceback.extract_tb(first.__traceback__)
    ours = [frame for frame in frames if _OUR_CODE.search(frame.filename) and frame.filename != __file__]
    if ours:
        reason += f" (at {Path(ours[-1].filename).name}:{ours[-1].lineno}, {ours[-1].name})"
    return reason


# Where the project's code is (the package, the zoo), to name the line a capture was refused at.
_OUR_CODE = re.compile(r"[/\\](lightning_hotcache|models)[/\\]")


def graphs_for(device: torch.device) -> Graphs | None:
    """Where a step on ``device`` is recorded: CUDA's graphs on a CUDA device; none elsewhere."""
    return CudaGraphs() if device.type == "cuda" else None


class FlagReadLater:
    """A device flag the host reads at a later step without waiting for the steps queued after
    it: copied into pinned host memory behind the step that set it, with an event after the
    copy, so that reading waits for that step alone (a read of the device tensor itself would
    wait for every step queued since). One flag in flight: read it before recording the next."""

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._host = torch.zeros((), dtype=torch.bool, pin_memory=cuda)
        self._copied = torch.cuda.Event() if cuda else None
        self.recorded = False

    def record(self, flag: Tensor) -> None:
        self._host.copy_(flag, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.recorded = True

    def read(self) -> bool:
        """The flag last recorded (False where none is); the flag is then spent."""
        if not self.recorded:
            return False
        if self._copied is not None:
            self._copied.synchronize()
        self.recorded = False
        return bool(self._host)
