"""Row collectives across two gloo processes: what each rank sends is what every rank gets."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_hotcache.cache.exchange import RowSharding, fetch_rows, route_to_owners, send_rows_along
from lightning_hotcache._ops.sorting import sum_rows_by_index
from lightning_hotcache.optim.rowwise import RowWiseOptimizer, RowWiseOptimizerConfig
from lightning_hotcache.distributed.sparse_ddp import average_row_gradients, average_sparse_gradients


def _parts(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Three tables of widths 3, 5, 2; rank 1 sends nothing for the second one.
    counts = [[2, 4, 1], [3, 0, 2]][rank]
    parts = []
    for t, (n, width) in enumerate(zip(counts, (3, 5, 2))):
        ids = torch.arange(n) + 100 * t + 10 * rank
        parts.append((ids, ids[:, None].float().repeat(1, width) + torch.arange(width)))
    return parts


def _answer(table: int, ids: torch.Tensor, owner: int | None) -> torch.Tensor:
    assert owner is None or bool((ids % 2 == owner).all()), "asked a rank for rows it does not own"
    width = 2 + table
    return ids[:, None].float() * (table + 1) + torch.arange(width)


def _collectives(rank: int) -> None:
    # Rows come from their owners (id % 2), whoever asks; each table answers with its own width.
    sharding = RowSharding(rank, 2, None)
    asked = [torch.tensor([5, 2, 7, 4, 4][rank * 2 :]), torch.tensor([[], [3, 8]][rank], dtype=torch.int64)]
    serves = [lambda ids, t=t: _answer(t, ids, rank) for t in range(2)]
    rows = fetch_rows(route_to_owners(asked, sharding), serves, [2, 3], sharding)
    for t in range(2):
        assert torch.equal(rows[t], _answer(t, asked[t], owner=None)), t
    # Gradient rows go to their owners: each rank gets exactly the rows of its ids, from rank 0's first.
    routed = route_to_owners([ids for ids, _ in _parts(rank)], sharding)
    got = send_rows_along(routed, [rows for _, rows in _parts(rank)], sharding).wait()
    for t, (ids, rows) in enumerate(zip(routed.ids, got)):
        every = [_parts(r)[t] for r in range(2)]
        mine = [(i[i % 2 == rank], x[i % 2 == rank]) for i, x in every]
        assert bool((ids % 2 == rank).all()), t
        assert torch.equal(ids, torch.cat([i for i, _ in mine])) and torch.equal(rows, torch.cat([x for _, x in mine])), t


# Tables of widths 4, 4, 2 and 4 (those of width 4 stacked in one collective).
GRADIENT_SHAPES = [(5, 4), (3, 4), (6, 2), (2, 4)]


def _sparse_gradients(rank: int) -> list[torch.Tensor | None]:
    # Repeated rows; rank 1 did not look the second table up, and no rank the fourth.
    rows = [[[0, 4, 0], [1, 2]], [[2], None], [[5, 5, 1], [0]], [None, None]]
    grads = []
    for t, (shape, per_rank) in enumerate(zip(GRADIENT_SHAPES, rows)):
        ids = per_rank[rank]
        if ids is None:
            grads.append(None)
            continue
        values = torch.arange(len(ids) * shape[1], dtype=torch.float32).view(len(ids), shape[1]) + 10 * t + rank
        grads.append(torch.sparse_coo_tensor(torch.tensor([ids]), values, shape))
    return grads


def _averaged_sparse_gradients(rank: int) -> None:
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in GRADIENT_SHAPES]
    for param, grad in zip(params, _sparse_gradients(rank)):
        param.grad = grad
    average_sparse_gradients(params)
    every = [_sparse_gradients(r) for r in range(2)]
    for t, param in enumerate(params):
        mine = [g[t] for g in every if g[t] is not None]
        if not mine:
            assert param.grad is None, f"table {t}: nobody looked it up, yet it got a gradient"
            continue
        expected = sum(g.to_dense() for g in mine) / 2
        assert param.grad.is_sparse and param.grad.is_coalesced(), t
        assert torch.equal(param.grad.to_dense(), expected), (t, param.grad.to_dense(), expected)


def _row_gradients_averaged_in_the_step(rank: int) -> None:
    # The zoo's way under DDP: rank 0 hands the width-4 tables' rows over as one piece, rank 1
    # has none of that width (it takes part with an empty one); the width-2 table's come as
    # .grad on both. The step averages each width over the ranks, as one process stepping the
    # mean gradient does (SGD: a first Adagrad or Adam step does not tell a sum from a mean).
    config = RowWiseOptimizerConfig("sgd", lr=0.1)
    every = [_sparse_gradients(r) for r in range(2)]
    sent = [every[0][:3], [None, None, every[1][2]]]  # per rank, per table: what it steps from
    tables, reference = ([torch.nn.Parameter(torch.ones(shape)) for shape in GRADIENT_SHAPES] for _ in range(2))
    optimizer = RowWiseOptimizer(tables, config)
    mine = every[rank]
    if rank == 0:
        rows = torch.cat([mine[0]._indices()[0], mine[1]._indices()[0] + GRADIENT_SHAPES[0][0]])
        optimizer.add_row_gradients(tables[:2], rows, torch.cat([mine[0]._values(), mine[1]._values()]))
    tables[2].grad = mine[2]
    optimizer.step(reduce_rows=average_row_gradients)
    for table, param in enumerate(reference[:3]):
        parts = [grads[table] for grads in sent if grads[table] is not None]
        param.grad = torch.sparse_coo_tensor(
            torch.cat([g._indices() for g in parts], dim=1), torch.cat([g._values() for g in parts]) / 2, param.shape
        )
    RowWiseOptimizer(reference, config).step()
    for table, (got, want) in enumerate(zip(tables, reference)):
        assert torch.equal(got, want), (table, got, want)
        assert got.grad is None, table


def _tables_kept_out_of_ddp(rank: int) -> None:
    # DeepFM has both kinds of tables: the embeddings and the first-order weights.
    from torchrec import EmbeddingBagCollection

    from models import create_model
    from tests.conftest import tiny_synthetic

    dm = tiny_synthetic()
    model = create_model("deepfm", dm.tables, dm.num_dense_features)
    tables = {
        f"{path}.{name}"
        for path, module in model.named_modules()
        if isinstance(module, EmbeddingBagCollection)
        for name, _ in module.named_parameters()
    }
    assert tables and any("first_order" in name for name in tables), tables
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    assert ddp.parameters_to_ignore == tables, ddp.parameters_to_ignore ^ tables


# Each check under the name of the test that asserts it, so that the spawn runs only the
# selected ones (``-k``).
TWO_PROCESS_CHECKS = {
    "test_row_collectives_on_two_processes": _collectives,
    "test_sparse_gradients_averaged_over_two_processes": _averaged_sparse_gradients,
    "test_row_gradients_averaged_in_the_step_over_two_processes": _row_gradients_averaged_in_the_step,
    "test_zoo_tables_are_kept_out_of_ddp": _tables_kept_out_of_ddp,
}


def _on_two_processes(checks: dict[str, Callable[[int], None]], directory: Path) -> dict[str, str]:
    """Run each of ``checks`` (name -> ``check(rank)``) in turn in one spawn of two gloo
    processes (a spawn imports torch and the project again in each, ~10 s): name -> the first
    failing rank's assertion, for the checks that failed."""
    queue = mp.get_context("spawn").Queue()
    mp.spawn(_worker, args=(checks, str(directory / "rendezvous"), queue), nprocs=2, join=True)
    failures: dict[str, str] = {}
    while not queue.empty():
        name, failure = queue.get()
        failures.setdefault(name, failure)
    return failures


def _worker(rank: int, checks: dict[str, Callable[[int], None]], init_file: str, failures) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for name, check in checks.items():
            try:
                check(rank)
            except AssertionError as err:
                failures.put((name, f"rank {rank}: {err!r}"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_process_failures(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The selected tests' checks, run in one spawn: test name -> its first failing assertion."""
    selected = {item.name for item in request.session.items}
    checks = {name: check for name, check in TWO_PROCESS_CHECKS.items() if name in selected}
    return _on_two_processes(checks, tmp_path_factory.mktemp("two_processes"))


def _passed_on_two_processes(failures: dict[str, str], request: pytest.FixtureRequest) -> None:
    name = request.node.name
    assert name in TWO_PROCESS_CHECKS, f"{name} has no check in TWO_PROCESS_CHECKS"
    assert name not in failures, failures[name]


def test_row_collectives_on_two_processes(two_process_failures: dict[str, str], request: pytest.FixtureRequest) -> None:
    _passed_on_two_processes(two_process_failures, request)


def test_rows_summed_by_index_table_by_table() -> None:
    # Tables of widths 2, 2 and 3 (the first two summed in one sort), with repeats, an empty
    # table, and an index equal to the next table's first key (no bleeding across tables).
    indices = [torch.tensor([3, 1, 3, 0]), torch.tensor([], dtype=torch.int64), torch.tensor([2, 2]), torch.tensor([0, 4])]
    rows = [torch.arange(8.0).view(4, 2), torch.zeros(0, 2), torch.ones(2, 3), torch.full((2, 2), 5.0)]
    summed = sum_rows_by_index(indices, rows, [4, 6, 3, 5])
    expected = [
        (torch.tensor([0, 1, 3]), torch.tensor([[6.0, 7.0], [2.0, 3.0], [4.0, 6.0]])),
        (torch.tensor([], dtype=torch.int64), torch.zeros(0, 2)),
        (torch.tensor([2]), torch.full((1, 3), 2.0)),
        (torch.tensor([0, 4]), torch.full((2, 2), 5.0)),
    ]
    for (ids, got), (want_ids, want) in zip(summed, expected):
        assert torch.equal(ids, want_ids) and torch.equal(got, want), (ids, got)


def test_sparse_gradients_averaged_over_two_processes(two_process_failures: dict[str, str], request: pytest.FixtureRequest) -> None:
    _passed_on_two_processes(two_process_failures, request)


def test_row_gradients_averaged_in_the_step_over_two_processes(two_process_failures: dict[str, str], request: pytest.FixtureRequest) -> None:
    _passed_on_two_processes(two_process_failures, request)


def test_zoo_tables_are_kept_out_of_ddp(two_process_failures: dict[str, str], request: pytest.FixtureRequest) -> None:
    """DDP's reducer corrupts the heap on sparse gradients now and then (see sparse_ddp): the
    model averages its tables' gradients itself, so DDP must not see (and reduce) any table."""
    _passed_on_two_processes(two_process_failures, request)


def test_dense_gradients_are_refused() -> None:
    param = torch.nn.Parameter(torch.zeros(3, 2))
    param.grad = torch.ones(3, 2)
    with pytest.raises(ValueError, match="sparse=True"):
        average_sparse_gradients([param])
