"""Host tier: the full table and its row-wise optimizer state, in RAM or in memory-mapped files.

Every row lives here; the device cache holds copies of some rows and writes changed ones
back. Rows travel together with their optimizer state, so a row's update never depends on
which tier it was in. For tables bigger than RAM the arrays are memory-mapped files in a
directory (created sparse and zero-filled by the OS, so creation is instant and only the
pages that are touched take disk space or page cache).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

# Copy tables into the store in chunks of this many bytes, so initializing a table larger
# than RAM never materializes it twice (deferred tables are also made in chunks this size).
CHUNK_BYTES = 64 * 2**20


def map_rows(path: Path, num_rows: int, width: int) -> np.ndarray:
    """A ``(num_rows, width)`` float32 array memory-mapped from ``path`` (created sparse if
    missing), advised for random access.

    Rows are read one at a time in no order, so the kernel's read-around (up to 128 KiB read
    per page fault, the default for mappings) would fetch mostly rows nobody asked for and
    push useful pages out of the page cache; MADV_RANDOM reads only the faulting page.
    Python's mmap is used instead of np.memmap because numpy has no public way to advise.
    """
    size = num_rows * width * 4
    with open(path, "r+b" if path.exists() else "w+b") as file:
        if size:
            file.truncate(size)
            mapping = mmap.mmap(file.fileno(), size)
            mapping.madvise(mmap.MADV_RANDOM)
        else:  # mmap cannot map zero bytes
            return np.zeros((0, width), dtype=np.float32)
    return np.ndarray((num_rows, width), dtype=np.float32, buffer=mapping)


class HostStore:
    """Rows ``[0, num_embeddings)`` of one table plus per-row optimizer state.

    Args:
        name: table name (names the files in ``directory``).
        num_embeddings: rows.
        embedding_dim: row width.
        state_widths: optimizer state name -> floats per row (see RowWiseOptimizerConfig.state_widths).
        directory: ``None`` keeps the arrays in RAM (pinned when ``pin_memory``); a path keeps
            them in memory-mapped files ``<name>.<array>.f32`` there.
        pin_memory: page-lock RAM arrays so host->device copies can be asynchronous (CUDA only).
    """

    def __init__(
        self,
        name: str,
        num_embeddings: int,
        embedding_dim: int,
        state_widths: dict[str, int],
        directory: str | Path | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.name = name
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.directory = Path(directory) if directory is not None else None
        widths = {"weight": embedding_dim, **state_widths}
        self._maps: list[np.ndarray] = []
        self.arrays: dict[str, Tensor] = {key: self._allocate(key, width, pin_memory) for key, width in widths.items()}

    def _allocate(self, key: str, width: int, pin_memory: bool) -> Tensor:
        if self.directory is None:
            tensor = torch.zeros(self.num_embeddings, width, dtype=torch.float32)
            return tensor.pin_memory() if pin_memory else tensor
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{self.name}.{key}.f32"
        if path.exists() and path.stat().st_size != self.num_embeddings * width * 4:
            raise ValueError(
                f"{path} holds {path.stat().st_size} bytes but table {self.name!r} needs "
                f"{self.num_embeddings} x {width} float32; remove it or choose another host_storage directory."
            )
        array = map_rows(path, self.num_embeddings, width)
        self._maps.append(array)
        return torch.from_numpy(array)

    @property
    def weight(self) -> Tensor:
        return self.arrays["weight"]

    def read(self, ids: Tensor) -> dict[str, Tensor]:
        """Copies of rows ``ids`` of every array."""
        ids = ids.cpu()
        return {key: array.index_select(0, ids) for key, array in self.arrays.items()}

    def write(self, ids: Tensor, rows: dict[str, Tensor]) -> None:
        """Overwrite rows ``ids`` of every array with ``rows`` (same keys as `read`)."""
        ids = ids.cpu()
        for key, array in self.arrays.items():
            array.index_copy_(0, ids, rows[key].to("cpu", torch.float32))

    def load(self, key: str, values: Tensor, start: int = 0) -> None:
        """Replace rows ``[start, start + len(values))`` of an array (``weight`` or a state
        name), chunk by chunk; the whole array by default."""
        array = self.arrays[key]
        if values.dim() != 2 or values.shape[1] != array.shape[1] or not 0 <= start <= start + len(values) <= len(array):
            raise ValueError(
                f"Table {self.name!r}: {key} has shape {tuple(array.shape)}; rows {tuple(values.shape)} "
                f"at row {start} do not fit."
            )
        step = max(1, CHUNK_BYTES // max(1, array.shape[1] * 4))
        for offset in range(0, len(values), step):
            chunk = values[offset : offset + step]
            array[start + offset : start + offset + len(chunk)].copy_(chunk)

    def flush_to_disk(self) -> None:
        """Make memory-mapped arrays durable (no-op in RAM)."""
        for array in self._maps:
            if isinstance(array.base, mmap.mmap):  # zero-row arrays map nothing
                array.base.flush()
