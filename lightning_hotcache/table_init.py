"""Deferred table initialization: tables declared on the meta device, rows made chunk by chunk.

A model whose tables are larger than RAM cannot build them in memory first and hand them
to a strategy afterwards. TorchRec's answer is to declare the EmbeddingBagCollection on the
``meta`` device and let the sharder initialize each shard where it lives; this module is
that answer for us. `initial_rows` yields a table's initial rows in chunks of bounded size,
with the table's own ``init_fn`` (TorchRec's default: uniform in +-sqrt(1/num_embeddings))
applied chunk by chunk, as TorchRec applies it shard by shard. The rows depend only on the
seed, never on the chunk size or on who writes them, so every rank of a job, and every
tier a row may live in, sees the same table.

`materialize_tables` is the in-memory case: strategies that do not place rows themselves
(``auto``, ``ddp``, ``torchrec``) get ordinary tables, allocated and initialized here.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor, nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from lightning_hotcache.cache.host import CHUNK_BYTES, RowsAt, rows_in


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


def initial_rows(
    table: EmbeddingBagConfig, seed: int, chunk_bytes: int = CHUNK_BYTES, into: RowsAt | None = None
) -> Iterator[tuple[int, Tensor]]:
    """``(first row, rows)`` chunks of about ``chunk_bytes`` covering the table in order (so
    initializing never holds more than one chunk beyond the table's destination): its
    ``init_fn`` applied to each chunk under ``seed``. The global RNG is left as it was.

    ``into(start, count)``, where given, is the destination of rows ``[start, start + count)``
    (contiguous float32 on the CPU): each chunk is made there, in place, and yielded as that
    tensor, so no copy follows (a host store fills 2-3x faster). The values are the same:
    a chunk draws the same numbers wherever it lies."""
    init_fn = table.init_fn
    assert init_fn is not None  # EmbeddingBagConfig.__post_init__ sets TorchRec's default
    step = max(1, chunk_bytes // (4 * table.embedding_dim))
    # fork_rng, not a torch.Generator: user init_fns take only the tensor and draw from the
    # global RNG. CPU draws are sequential, so one stream split into chunks equals one draw.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, table.num_embeddings, step):
            count = min(step, table.num_embeddings - start)
            rows = torch.empty(count, table.embedding_dim) if into is None else into(start, count)
            init_fn(rows)
            yield start, rows


def materialize_tables(module: nn.Module, device: torch.device | str = "cpu", seed: int | None = None) -> bool:
    """Allocate and initialize the deferred tables of every EmbeddingBagCollection in ``module``
    on ``device``, in place. ``seed=None`` draws one from the global RNG. Returns whether any
    table was deferred."""
    found = False
    for collection in module.modules():
        if not isinstance(collection, EmbeddingBagCollection) or not is_deferred(collection):
            continue
        found = True
        seed = draw_seed() if seed is None else seed
        collection.to_empty(device=device)
        collection._device = torch.device(device)  # torchrec reads it in reset_parameters and sharding
        for table in collection.embedding_bag_configs():
            weight = collection.embedding_bags[table.name].weight
            with torch.no_grad():
                in_place = weight.device.type == "cpu" and weight.is_contiguous()
                for start, rows in initial_rows(table, seed, into=rows_in(weight) if in_place else None):
                    if not in_place:
                        weight[start : start + len(rows)].copy_(rows)
    return found
