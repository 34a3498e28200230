"""Host tier: the full table and its row-wise optimizer state, in RAM or in memory-mapped files.

Every row lives here; the device cache holds copies of some rows and writes changed ones
back. Rows travel together with their optimizer state, so a row's update never depends on
which tier it was in. For tables bigger than RAM the arrays are memory-mapped files in a
directory, zero-filled by the OS, their disk space reserved when they are made (see
`map_rows`); only the pages that are touched take page cache.

A run owns its directory (`HostDirectory`): it holds an exclusive lock on it while it
trains, and its files start fresh, so nothing (row optimizer state above all) leaks in from
an earlier run or from a concurrent one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import resource
import socket
import sys
import warnings
import weakref
from typing import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from lightning_hotcache.cache.host_arrays import new_host_array
from lightning_hotcache.cache.read_ahead import read_ahead_later
from lightning_hotcache._ops.host_rows import on_cpu, put_rows
from lightning_hotcache._ops.progress import Progress

# Copy tables into the store in chunks of this many bytes, so initializing a table larger
# than RAM never materializes it twice (deferred tables are also made in chunks this size).
CHUNK_BYTES = 64 * 2**20


class HostStorageInUseError(RuntimeError):
    """Another process (or another module of this one) holds the host storage directory."""


class HostDirectory:
    """A directory of memory-mapped host tables, owned by one run while it holds the lock.

    The lock is an exclusive ``flock`` on ``.hotcache.lock`` inside the directory, taken
    without waiting: a second run on the same directory fails at once with the holder's pid,
    host and command line instead of silently overwriting the first run's rows. The kernel
    drops the lock when the process dies, so a crash never leaves the directory locked.

    Files are never reused: `create` unlinks an existing file and makes a new one, so a run
    starts from zeroed row state (a checkpoint restores state explicitly), and a model of an
    earlier run that still maps the old file keeps its own rows. Symlinks and hard-linked lock
    files are refused: in a shared directory a planted link would make training write
    wherever it points.
    """

    LOCK_NAME = ".hotcache.lock"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(
                f"host_storage {self.path} is a file; it must be a directory (created if missing) for the "
                "memory-mapped tables, or 'memory'."
            )
        self._fd: int | None = None
        self._finalizer: weakref.finalize | None = None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.acquire()  # the first write there: the lock file
        except OSError as err:
            if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                problem = "is not writable"
            elif err.errno in (errno.ENOENT, errno.ENOTDIR):  # a folder on its way that cannot hold folders
                problem = "cannot be made"
            else:
                raise
            raise OSError(
                err.errno,
                f"host_storage {self.path} {problem} ({err.strerror}): the memory-mapped tables and the run's "
                "lock are written there. Give a writable directory, or 'memory'.",
            ) from None

    @property
    def locked(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the directory's lock (no-op while held); fails fast if someone else holds it."""
        if self._fd is not None:
            return
        lock = self.path / self.LOCK_NAME
        fd = _open_no_symlink(lock, os.O_RDWR | os.O_CREAT)
        # Checked on the open file, before it is truncated: a second name for the same inode
        # (a hard link, which O_NOFOLLOW cannot see) would let the lock overwrite a file anywhere.
        links = os.fstat(fd).st_nlink
        if links > 1:
            os.close(fd)
            raise ValueError(
                f"{lock} is a hard link ({links} names for one file); hotcache would overwrite the linked file "
                "with its lock. Remove it (the other names keep their data) or use another directory."
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "an unknown process"
            os.close(fd)
            if holder.startswith(f"pid {os.getpid()} "):
                raise HostStorageInUseError(
                    f"host_storage {self.path} is in use by this process ({holder}): an earlier fit or module here "
                    "still holds it. Let that run end (its teardown releases the directory), or give this run its "
                    "own host_storage directory."
                ) from None
            raise HostStorageInUseError(
                f"host_storage {self.path} is in use by {holder}. Two runs on one directory would overwrite each "
                "other's rows: give this run its own host_storage directory, or wait for the other run to end."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} ({' '.join(sys.argv)})\n".encode(), 0)
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)  # closing the file drops the lock
        _LOCKED.add(self)

    def _forget_in_child(self) -> None:
        """In a forked child (a DataLoader worker): close the inherited lock. A child holding it
        would keep the directory locked after the parent released it."""
        if self._finalizer is not None:
            self._finalizer.detach()
            with contextlib.suppress(OSError):
                os.close(self._fd)  # type: ignore[arg-type]
        self._fd, self._finalizer = None, None

    def release(self) -> None:
        """Drop the lock (the mapped files stay usable by this process)."""
        if self._finalizer is not None:
            self._finalizer()
        self._fd, self._finalizer = None, None

    def create(self, name: str, num_rows: int, width: int) -> np.ndarray:
        """A new zero-filled ``(num_rows, width)`` float32 file ``name``, mapped (see `map_rows`)."""
        if not self.locked:
            raise RuntimeError(f"host_storage {self.path} is not locked by this run; call acquire() first.")
        path = self.path / name
        if path.is_symlink():
            raise ValueError(
                f"{path} is a symlink; hotcache writes table files only inside host_storage and refuses links "
                "(a planted link would redirect training writes). Remove it or use another directory."
            )
        if path.exists():
            path.unlink()  # a new inode: whoever still maps the old file keeps its rows
        return map_rows(path, num_rows, width)


# Directories locked by this process, whose locks its forked children close at once.
_LOCKED: "weakref.WeakSet[HostDirectory]" = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: [directory._forget_in_child() for directory in list(_LOCKED)])


def _open_no_symlink(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ValueError(
                f"{path} is a symlink; hotcache refuses links inside host_storage (a planted link would redirect "
                "training writes). Remove it or use another directory."
            ) from None
        raise


def map_rows(path: Path, num_rows: int, width: int) -> np.ndarray:
    """A ``(num_rows, width)`` float32 array memory-mapped from ``path`` (created if missing;
    never through a symlink), its disk space reserved (`_reserve`), advised for random access.

    Rows are read one at a time in no order, so the kernel's read-around (up to 128 KiB read
    per page fault, the default for mappings) would fetch mostly rows nobody asked for and
    push useful pages out of the page cache; MADV_RANDOM reads only the faulting page.
    Python's mmap is used instead of np.memmap because numpy has no public way to advise.
    """
    size = num_rows * width * 4
    with os.fdopen(_open_no_symlink(path, os.O_RDWR | os.O_CREAT), "r+b") as file:
        if size:
            _reserve(file.fileno(), path, size)
            mapping = mmap.mmap(file.fileno(), size)
            mapping.madvise(mmap.MADV_RANDOM)
        else:  # mmap cannot map zero bytes
            return np.zeros((0, width), dtype=np.float32)
    return np.ndarray((num_rows, width), dtype=np.float32, buffer=mapping)


def _reserve(fd: int, path: Path, size: int) -> None:
    """Extend the file to ``size`` bytes with all of its disk blocks allocated now.

    A sparse file takes a block when a page is first written through the mapping; on a full
    disk that write faults and the kernel kills the process with SIGBUS, mid-training and
    with no message. Reserving fails here instead, before any row is written, naming what is
    needed. Filesystems that cannot reserve get the sparse file and a warning.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            os.ftruncate(fd, 0)  # give back what was reserved before the disk filled
            path.unlink()
            disk = os.statvfs(path.parent)
            free = disk.f_bavail * disk.f_frsize
            what = "disk quota" if err.errno == errno.EDQUOT else "disk"
            raise OSError(
                err.errno,
                f"host_storage {path.parent} has too little {what} for {path.name}: it needs {size:,} bytes, "
                f"{free:,} are free. The memory-mapped host tables reserve their whole size when they are made, "
                "so a full disk cannot kill training later; free space there, or set host_storage to a directory "
                "on a larger disk (or 'memory').",
            ) from None
        if err.errno == errno.EFBIG:
            path.unlink()
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            allowed = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit:,} bytes"
            raise OSError(
                err.errno,
                f"host_storage {path.parent}: {path.name} needs {size:,} bytes, more than one file may hold here "
                f"(this process' file-size limit, `ulimit -f`, is {allowed}; or the filesystem's own). Raise the "
                "limit, or set host_storage to a directory on a filesystem that takes files this large (or 'memory').",
            ) from None
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        warnings.warn(
            f"host_storage {path.parent}: this filesystem cannot reserve space ({err.strerror}); {path.name} is a "
            "sparse file, and if the disk fills during training the process dies with SIGBUS.",
            stacklevel=3,
        )
        os.ftruncate(fd, size)


# Rows [start, start + count) of a table's home, where its initial rows are made in place
# (`lightning_hotcache.embedding.table_init.initial_rows`).
RowsAt = Callable[[int, int], Tensor]


def rows_in(array: Tensor) -> RowsAt:
    """`RowsAt` of a contiguous array on the CPU: views of its rows."""
    return lambda start, count: array[start : start + count]


class HostStore:
    """Rows ``[0, num_embeddings)`` of one table plus per-row optimizer state.

    Args:
        name: table name (names the files in ``directory``).
        num_embeddings: rows.
        embedding_dim: row width.
        state_widths: optimizer state name -> floats per row (see RowWiseOptimizerConfig.state_widths).
        directory: ``None`` keeps the arrays in RAM; a locked `HostDirectory` keeps them in new
            memory-mapped files ``<name>.<array>.f32`` there. Neither is page-locked: rows go to
            a CUDA device through small pinned buffers (`lightning_hotcache.cache.upload`).
    """

    def __init__(
        self,
        name: str,
        num_embeddings: int,
        embedding_dim: int,
        state_widths: dict[str, int],
        directory: HostDirectory | None = None,
    ) -> None:
        self.name = name
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.directory = directory
        self.memory_mapped = directory is not None
        widths = {"weight": embedding_dim, **state_widths}
        self._maps: list[np.ndarray] = []
        self.arrays: dict[str, Tensor] = {key: self._allocate(key, width) for key, width in widths.items()}

    def _allocate(self, key: str, width: int) -> Tensor:
        if self.directory is None:
            # Misses and write-backs touch random rows: 2 MiB pages spare their TLB misses, and
            # keeping the array out of forked DataLoader workers spares each write-back a
            # copy-on-write fault per page (see `host_arrays`).
            return new_host_array((self.num_embeddings, width), fill=None)  # table init fills it
        array = self.directory.create(f"{self.name}.{key}.f32", self.num_embeddings, width)
        self._maps.append(array)
        return torch.from_numpy(array)

    @classmethod
    def rows_of(cls, store: "HostStore", name: str, start: int, num_rows: int) -> "HostStore":
        """Rows ``[start, start + num_rows)`` of ``store`` as a store of their own, sharing its
        memory: a table's rows in the host store of a stack of tables (see
        `lightning_hotcache.embedding.layout`), which reads and writes all of them at once."""
        view = cls.__new__(cls)  # no arrays of its own to allocate
        view.name, view.num_embeddings, view.embedding_dim, view.directory = name, num_rows, store.embedding_dim, None
        view.memory_mapped = store.memory_mapped
        view._maps = []  # the stack's store flushes the files
        view.arrays = {key: array[start : start + num_rows] for key, array in store.arrays.items()}
        return view

    @property
    def weight(self) -> Tensor:
        return self.arrays["weight"]

    def read(self, ids: Tensor) -> dict[str, Tensor]:
        """Copies of rows ``ids`` of every array."""
        ids = on_cpu(ids)
        return {key: array.index_select(0, ids) for key, array in self.arrays.items()}

    def read_ahead(self, ids: Tensor) -> bool:
        """Have the kernel page in rows ``ids`` (ascending) of memory-mapped arrays before they
        are read, on the read-ahead thread (`lightning_hotcache.cache.read_ahead`); whether it
        was asked to. Rows in RAM are there already."""
        return self.memory_mapped and read_ahead_later(list(self.arrays.values()), ids)

    def write(self, ids: Tensor, rows: dict[str, Tensor]) -> None:
        """Overwrite rows ``ids`` of every array with ``rows`` (same keys as `read`)."""
        ids = on_cpu(ids)
        for key, array in self.arrays.items():
            put_rows(array, ids, on_cpu(rows[key], torch.float32))

    def load(self, key: str, values: Tensor, start: int = 0, progress: Progress | None = None) -> None:
        """Replace rows ``[start, start + len(values))`` of an array (``weight`` or a state
        name), chunk by chunk; the whole array by default. ``progress`` is told the bytes of
        each chunk once it is in."""
        array = self.arrays[key]
        if values.dim() != 2 or values.shape[1] != array.shape[1] or not 0 <= start <= start + len(values) <= len(array):
            raise ValueError(
                f"Table {self.name!r}: {key} has shape {tuple(array.shape)}; rows {tuple(values.shape)} "
                f"at row {start} do not fit."
            )
        step = max(1, CHUNK_BYTES // max(1, array.shape[1] * 4))
        for offset in range(0, len(values), step):
            chunk = values[offset : offset + step]
            target = array[start + offset : start + offset + len(chunk)]
            if chunk.data_ptr() != target.data_ptr():  # else made in place (see `rows_at`)
                target.copy_(chunk)
            if progress is not None:
                progress(target.numel() * target.element_size())

    def rows_at(self, key: str) -> RowsAt:
        """Rows of an array, to be written in place (`initial_rows`'s ``into``; `load` then
        finds them there and copies nothing)."""
        return rows_in(self.arrays[key])

    def flush_to_disk(self) -> None:
        """Make memory-mapped arrays durable (no-op in RAM)."""
        for array in self._maps:
            if isinstance(array.base, mmap.mmap):  # zero-row arrays map nothing
                array.base.flush()
