"""Deferred table initialization: tables declared on the meta device, rows made chunk by chunk.

A model whose tables are larger than RAM cannot build them in memory first and hand them
to a strategy afterwards. TorchRec's answer is to declare the EmbeddingBagCollection on the
``meta`` device and let the sharder initialize each shard where it lives; this module is
that answer for us. `initial_rows` yields a table's initial rows in chunks of bounded size,
with the table's own ``init_fn`` (TorchRec's default: uniform in +-sqrt(1/num_embeddings))
applied block by block, as TorchRec applies it shard by shard. The rows depend only on the
seed and the table's name, never on the chunk size, the thread count or who writes them, so
every rank of a job, and every tier a row may live in, sees the same table.

Each block of rows draws from a generator of its own, seeded from (seed, table, block): one
generator's draws on the CPU are sequential (~1 GB/s on one core, so the 17 GB of the Criteo
tables at dim 128 took ~17 s before the first step), while blocks fill side by side, one per
core, where the ``init_fn`` takes a ``generator`` (``torch.nn.init``'s do; others run block
by block under the global RNG, seeded the same way, so they give the same rows).

`materialize_tables` is the in-memory case: strategies that do not place rows themselves
(``auto``, ``ddp``, ``torchrec``) get ordinary tables, allocated and initialized here.
"""

from __future__ import annotations

import inspect
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from lightning_hotcache.cache.host import CHUNK_BYTES, RowsAt, rows_in
from lightning_hotcache._ops.progress import byte_bar
from lightning_hotcache.optim.stacked_tables import allocate_stacked


def is_deferred(collection: EmbeddingBagCollection) -> bool:
    """Whether the collection's tables are declared only (meta device), with no rows yet."""
    return any(p.is_meta for p in collection.parameters())


@contextmanager
def deferred_tables_left_out_of_moves(module: nn.Module | None) -> Iterator[None]:
    """Within it, ``module.to(...)``/``.cpu()`` leave tables still on the meta device alone.

    Lightning's teardown moves the model to the CPU after a failed fit too; when the fit failed
    before the tables were made (a budget the planner refuses), copying a meta tensor raises,
    "during handling of" the real error, which then is not the last thing the user reads. The
    tables cannot be allocated to be moved: they may be larger than RAM.
    """
    deferred = [m for m in module.modules() if isinstance(m, EmbeddingBagCollection) and is_deferred(m)] if module is not None else []
    for collection in deferred:
        # `nn.Module._apply` is what every move recurses through; an instance attribute shadows it.
        collection._apply = lambda fn, recurse=True, collection=collection: collection  # type: ignore[method-assign]
    try:
        yield
    finally:
        for collection in deferred:
            del collection._apply


def draw_seed() -> int:
    """A seed for `initial_rows` from the global RNG (so ``seed_everything`` fixes it)."""
    return int(torch.randint(0, 2**62, (1,)).item())


# Values per block of rows with a generator of its own (4 MiB of float32): small enough that a
# 64 MiB chunk gives every core of a GPU host a block, large enough that seeding costs nothing.
BLOCK_VALUES = 2**20


def initial_rows(
    table: EmbeddingBagConfig, seed: int, chunk_bytes: int = CHUNK_BYTES, into: RowsAt | None = None
) -> Iterator[tuple[int, Tensor]]:
    """``(first row, rows)`` chunks of about ``chunk_bytes`` (whole blocks) covering the table
    in order (so initializing never holds more than one chunk beyond the table's
    destination): its ``init_fn`` applied to each block of rows under that block's seed. The
    global RNG is left as it was.

    ``into(start, count)``, where given, is the destination of rows ``[start, start + count)``
    (contiguous float32 on the CPU): each chunk is made there, in place, and yielded as that
    tensor, so no copy follows (a host store fills 2-3x faster). The values are the same:
    a block draws the same numbers wherever it lies."""
    init_fn = table.init_fn
    assert init_fn is not None  # EmbeddingBagConfig.__post_init__ sets TorchRec's default
    block = max(1, BLOCK_VALUES // table.embedding_dim)  # rows
    step = block * max(1, chunk_bytes // (4 * table.embedding_dim * block))
    salt = zlib.crc32(table.name.encode())
    # Threads only where the init_fn takes a generator; the others draw under the global RNG.
    pool = ThreadPoolExecutor(max(1, torch.get_num_threads())) if _takes_generator(init_fn) else None
    with pool or nullcontext(), torch.random.fork_rng(devices=[]):
        for start in range(0, table.num_embeddings, step):
            count = min(step, table.num_embeddings - start)
            rows = torch.empty(count, table.embedding_dim) if into is None else into(start, count)
            blocks = [(_block_seed(seed, salt, (start + at) // block), rows[at : at + block]) for at in range(0, count, block)]
            _draw(init_fn, blocks, pool)
            yield start, rows


def initial_rows_of(
    tables: Sequence[EmbeddingBagConfig], seed: int, into: Callable[[EmbeddingBagConfig], RowsAt | None]
) -> Iterator[tuple[EmbeddingBagConfig, int, Tensor]]:
    """`initial_rows` of every table in turn, as ``(table, first row, rows)``, each table's made
    where ``into(table)`` says; a bar counts the bytes where the tables are large (`byte_bar`)."""
    total = sum(4 * t.num_embeddings * t.embedding_dim for t in tables)
    with byte_bar(total, "initializing tables") as bar:
        for table in tables:
            for start, rows in initial_rows(table, seed, into=into(table)):
                yield table, start, rows
                bar.update(4 * rows.numel())


def _takes_generator(init_fn: Callable[..., object]) -> bool:
    try:
        return "generator" in inspect.signature(init_fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def _draw(init_fn: Callable[..., object], blocks: list[tuple[int, Tensor]], pool: ThreadPoolExecutor | None) -> None:
    """``init_fn`` on each ``(seed, rows)`` block: on ``pool``'s threads, each with a generator
    of its own (the draws release the GIL), or one after another under the global RNG (user
    init_fns that take only the tensor; the caller forked the RNG)."""
    if pool is not None:
        list(pool.map(lambda block: init_fn(block[1], generator=torch.Generator().manual_seed(block[0])), blocks))
        return
    for seed, rows in blocks:
        torch.manual_seed(seed)
        init_fn(rows)


def _block_seed(seed: int, salt: int, block: int) -> int:
    """A 63-bit seed for one block of one table: splitmix64 of the three, so that neighbouring
    blocks and tables get unrelated streams (the seeds of a Mersenne twister that differ in a
    few bits start out correlated)."""
    mask = 2**64 - 1
    z = (seed * 0x9E3779B97F4A7C15 + salt * 0xBF58476D1CE4E5B9 + block * 0x94D049BB133111EB + 1) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1


def materialize_tables(module: nn.Module, device: torch.device | str = "cpu", seed: int | None = None) -> bool:
    """Allocate and initialize the deferred tables of every EmbeddingBagCollection in ``module``
    on ``device``, in place (a collection's tables as one stack where they can be:
    `lightning_hotcache.optim.stacked_tables`). ``seed=None`` draws one from the global RNG. Returns whether any
    table was deferred."""
    found = False
    for collection in module.modules():
        if not isinstance(collection, EmbeddingBagCollection) or not is_deferred(collection):
            continue
        found = True
        seed = draw_seed() if seed is None else seed
        if not allocate_stacked(collection, torch.device(device)):
            collection.to_empty(device=device)
        collection._device = torch.device(device)  # torchrec reads it in reset_parameters and sharding
        weights = {name: bag.weight for name, bag in collection.embedding_bags.items()}
        in_place = {name: w.device.type == "cpu" and w.is_contiguous() for name, w in weights.items()}
        tables = collection.embedding_bag_configs()
        with torch.no_grad():
            for table, start, rows in initial_rows_of(tables, seed, lambda t: rows_in(weights[t.name]) if in_place[t.name] else None):
                if not in_place[table.name]:
                    weights[table.name][start : start + len(rows)].copy_(rows)
    return found
