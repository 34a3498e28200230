"""The Triton table-batched embedding against the PyTorch path: the same pooled rows, and the
same rows and row-wise state after its fused backward (on a CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

triton_tbe = pytest.importorskip("lightning_hotcache.kernels.triton_tbe")
if triton_tbe.why_unavailable(torch.device("cuda" if torch.cuda.is_available() else "cpu")) is not None:
    pytest.skip("Triton cannot run here (not installed, or a CPU without TRITON_INTERPRET=1)", allow_module_level=True)

from lightning_hotcache.optim.rowwise import RowWiseOptimizerConfig, step_rows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.kernels  # `make gpu-check` runs them on the GPU's own kernels


def stack_batch(table_rows: list[int], batch: int, max_len: int, seed: int, empty_share: float = 0.2):
    """A feature-major batch over a stack of tables (one feature each): ids at random (the last
    row of every table among them, repeats kept), some bags empty, per-sample weights."""
    generator = torch.Generator().manual_seed(seed)
    firsts = torch.tensor([0, *table_rows]).cumsum(0)
    indices, lengths = [], []
    for table, rows in enumerate(table_rows):
        for b in range(batch):
            n = 0 if torch.rand((), generator=generator) < empty_share else int(torch.randint(1, max_len + 1, (), generator=generator))
            ids = torch.randint(0, rows, (n,), generator=generator)
            if b == 0 and n:
                ids[0] = rows - 1  # the table's last row
            indices.append(ids + firsts[table])
            lengths.append(n)
    indices = torch.cat(indices)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(lengths).cumsum(0)])
    weights = torch.rand(indices.numel(), generator=generator) + 0.5
    return indices, offsets, weights


def reference_pooled(weight, indices, offsets, bag_mean, per_sample):
    out = torch.zeros(offsets.numel() - 1, weight.shape[1])
    for bag in range(offsets.numel() - 1):
        a, b = int(offsets[bag]), int(offsets[bag + 1])
        rows = weight[indices[a:b]]
        if per_sample is not None:
            rows = rows * per_sample[a:b, None]
        out[bag] = rows.sum(0)
        if bag_mean is not None and bag_mean[bag] and b > a:
            out[bag] /= b - a
    return out


def reference_step(rule, weight, momentum, grad, indices, offsets, bag_mean, per_sample, lr=0.05):
    """The PyTorch path: each value's gradient row summed per distinct row, then `step_rows`."""
    lengths = offsets.diff()
    bag_of_value = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    scale = torch.ones(indices.numel()) if per_sample is None else per_sample.clone()
    if bag_mean is not None:
        scale *= torch.where(bag_mean.bool(), 1.0 / lengths.clamp(min=1), torch.ones_like(lengths, dtype=torch.float32))[bag_of_value]
    rows, inverse = torch.unique(indices, return_inverse=True)
    summed = torch.zeros(rows.numel(), weight.shape[1]).index_add_(0, inverse, grad[bag_of_value] * scale[:, None])
    state = {"momentum": momentum.view(-1, 1)} if rule == "rowwise_adagrad" else {}
    step_rows(RowWiseOptimizerConfig(name=rule, lr=lr), weight, state, rows, summed)


CASES = {
    "one_width": dict(table_rows=[50, 1, 7], dim=8),
    "wide_odd_dim": dict(table_rows=[30, 20], dim=12),
    "one_row_tables": dict(table_rows=[1, 1, 1], dim=4),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("pooling", ["sum", "mean", "mixed"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_pooled_rows_are_embedding_bags(case, pooling, weighted) -> None:
    table_rows, dim = CASES[case]["table_rows"], CASES[case]["dim"]
    batch = 6
    indices, offsets, per_sample = stack_batch(table_rows, batch, max_len=5, seed=1)
    weight = torch.randn(sum(table_rows), dim, generator=torch.Generator().manual_seed(2))
    features = torch.arange(len(table_rows)).repeat_interleave(batch)
    bag_mean = {"sum": None, "mean": torch.ones_like(features), "mixed": features % 2}[pooling]
    per_sample = per_sample if weighted else None
    got = triton_tbe.pooled(*(t.to(DEVICE) if t is not None else None for t in (weight, indices, offsets, bag_mean, per_sample)))
    torch.testing.assert_close(got.cpu(), reference_pooled(weight, indices, offsets, bag_mean, per_sample), rtol=1e-6, atol=1e-6)
    if pooling == "sum" and not weighted:  # torch's own, where it pools the same way
        expected = torch.nn.functional.embedding_bag(indices, weight, offsets, mode="sum", include_last_offset=True)
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rule", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("pooling", ["sum", "mixed"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_backward_steps_each_distinct_row_as_the_pytorch_path(case, rule, pooling, weighted) -> None:
    table_rows, dim = CASES[case]["table_rows"], CASES[case]["dim"]
    batch = 6
    weight = torch.randn(sum(table_rows), dim, generator=torch.Generator().manual_seed(3))
    momentum = torch.rand(sum(table_rows), generator=torch.Generator().manual_seed(4))
    expected_weight, expected_momentum = weight.clone(), momentum.clone()
    features = torch.arange(len(table_rows)).repeat_interleave(batch)
    bag_mean = None if pooling == "sum" else features % 2
    for step in range(3):  # rows stepped again read their stepped values and state
        indices, offsets, per_sample = stack_batch(table_rows, batch, max_len=5, seed=10 + step)
        per_sample = per_sample if weighted else None
        grad = torch.randn(offsets.numel() - 1, dim, generator=torch.Generator().manual_seed(20 + step))
        on = [t.to(DEVICE) if t is not None else None for t in (indices, offsets, bag_mean, per_sample, grad)]
        triton_weight, triton_momentum = weight.to(DEVICE), momentum.to(DEVICE)
        triton_tbe.backward_step(
            triton_weight, on[4], on[0], on[1], rule, lr=0.05, eps=1e-10, momentum=triton_momentum, bag_mean=on[2], per_sample_weights=on[3]
        )
        weight, momentum = triton_weight.cpu(), triton_momentum.cpu()
        reference_step(rule, expected_weight, expected_momentum, grad, indices, offsets, bag_mean, per_sample)
        torch.testing.assert_close(weight, expected_weight, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(momentum, expected_momentum, rtol=1e-6, atol=1e-6)


def test_every_id_repeated_steps_its_row_once_from_the_sum() -> None:
    # One row read by every value: one program sums the whole run.
    weight = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    indices = torch.full((40,), 2, dtype=torch.int64)
    offsets = torch.arange(0, 41, 4)
    grad = torch.randn(10, 8, generator=torch.Generator().manual_seed(6))
    expected = weight.clone()
    expected[2] -= 0.1 * grad.repeat_interleave(4, 0).sum(0)
    stepped = weight.to(DEVICE)
    triton_tbe.backward_step(stepped, grad.to(DEVICE), indices.to(DEVICE), offsets.to(DEVICE), "sgd", lr=0.1, eps=1e-10)
    torch.testing.assert_close(stepped.cpu(), expected, rtol=1e-6, atol=1e-5)


CHUNK, SPAN = triton_tbe._CHUNK, triton_tbe._SPAN


@pytest.mark.parametrize("hot", [CHUNK - 1, CHUNK, CHUNK + 1, (SPAN + 2) * CHUNK + 5], ids=lambda n: f"{n}-values")
@pytest.mark.parametrize(("rule", "tiers"), [("sgd", "device"), ("rowwise_adagrad", "device"), ("rowwise_adagrad", "device-and-host")])
def test_runs_across_chunks_step_their_row_once_from_the_sum(hot, rule, tiers) -> None:
    """A hot row read by ``hot`` values beside rows read once and a row read a chunk's worth:
    runs that start and end inside chunks, on their edges and across more chunks than the
    second launch sums at a time; with two tiers, some of them rows of the host array."""
    generator = torch.Generator().manual_seed(hot)
    counts = {0: 1, 1: hot, 2: 2, 3: CHUNK, 4: 1, 5: 3}
    rows = torch.cat([torch.full((n,), row) for row, n in counts.items()])
    rows = rows[torch.randperm(len(rows), generator=generator)]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randint(1, 3, (len(rows),), generator=generator).cumsum(0)])
    offsets = offsets[offsets <= len(rows)]
    offsets[-1] = len(rows)  # bags of one or two values
    grad = torch.randn(offsets.numel() - 1, 8, generator=generator)
    weight = torch.randn(6, 8, generator=generator)
    momentum = torch.rand(6, generator=generator)
    expected_weight, expected_momentum = weight.clone(), momentum.clone()
    reference_step(rule, expected_weight, expected_momentum, grad, rows, offsets, None, None)
    if tiers == "device":
        stepped, state = weight.to(DEVICE), momentum.to(DEVICE)
        triton_tbe.backward_step(stepped, grad.to(DEVICE), rows.to(DEVICE), offsets.to(DEVICE), rule, 0.05, 1e-10, momentum=state)
    else:  # rows 1, 3 and 5 live in the host array, as rows 0, 1 and 2 there
        on_host = rows % 2 == 1
        locations = torch.where(on_host, triton_tbe.location_of_host_row(rows // 2), rows)
        slots, slot_state = weight.clone().to(DEVICE), momentum.clone().to(DEVICE)
        host, host_state = weight[1::2].clone().to(DEVICE), momentum[1::2].clone().to(DEVICE)  # any memory the kernel reaches
        triton_tbe.backward_step(slots, grad.to(DEVICE), locations.to(DEVICE), offsets.to(DEVICE), rule, 0.05, 1e-10,
                                 momentum=slot_state, host_weight=host, host_momentum=host_state)  # fmt: skip
        stepped, state = slots.cpu(), slot_state.cpu()
        stepped[1::2], state[1::2] = host.cpu(), host_state.cpu()
    torch.testing.assert_close(stepped.cpu(), expected_weight, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(state.cpu(), expected_momentum, rtol=1e-6, atol=1e-6)


def test_the_module_trains_in_its_backward_as_the_pytorch_path() -> None:
    table_rows, dim, batch = [40, 9], 8, 5
    weight = torch.randn(sum(table_rows), dim, generator=torch.Generator().manual_seed(7))
    expected_weight, expected_momentum = weight.clone(), torch.zeros(sum(table_rows))
    tbe = triton_tbe.TritonTableBatchedEmbedding(weight.clone().to(DEVICE), "rowwise_adagrad", lr=0.05, eps=1e-10)
    for step in range(2):
        indices, offsets, _ = stack_batch(table_rows, batch, max_len=4, seed=30 + step)
        upstream = torch.randn(offsets.numel() - 1, dim, generator=torch.Generator().manual_seed(40 + step))
        out = tbe(indices.to(DEVICE), offsets.to(DEVICE))
        torch.testing.assert_close(out.detach().cpu(), reference_pooled(expected_weight, indices, offsets, None, None), rtol=1e-6, atol=1e-6)
        (out * upstream.to(DEVICE)).sum().backward()
        reference_step("rowwise_adagrad", expected_weight, expected_momentum, upstream, indices, offsets, None, None)
    torch.testing.assert_close(tbe.weight.detach().cpu(), expected_weight, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tbe.momentum.cpu(), expected_momentum, rtol=1e-6, atol=1e-6)


def test_rules_the_kernel_does_not_apply_are_refused_with_the_way_out() -> None:
    with pytest.raises(ValueError, match=r"not 'adam': use kernel='pytorch'"):
        triton_tbe.TritonTableBatchedEmbedding(torch.zeros(2, 4, device=DEVICE), "adam", lr=0.1, eps=1e-8)


def test_backward_reads_no_count_from_the_device(monkeypatch) -> None:
    # What a CUDA graph needs: no host read of a device value in the step (`.item()`, `.tolist()`,
    # `nonzero`, sizing a `unique`).
    indices, offsets, _ = stack_batch([20, 5], 4, max_len=3, seed=8)
    weight = torch.randn(25, 8).to(DEVICE)

    def refuse(*args, **kwargs):
        raise AssertionError("a host read of a device value")

    launched = []

    class Kernel:  # the launch itself is Triton's (on a CPU its interpreter reads everything): recorded
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(grid)

    monkeypatch.setattr(triton_tbe, "_backward_chunks_kernel", Kernel())
    monkeypatch.setattr(triton_tbe, "_long_runs_kernel", Kernel())

    for name in ("item", "tolist", "nonzero", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(torch, "unique", refuse)
    monkeypatch.setattr(torch, "nonzero", refuse)
    grad = torch.ones(offsets.numel() - 1, 8, device=DEVICE)
    momentum = torch.zeros(25, device=DEVICE)
    triton_tbe.backward_step(weight, grad, indices.to(DEVICE), offsets.to(DEVICE), "rowwise_adagrad", 0.1, 1e-10, momentum)
    chunks = -(-indices.numel() // triton_tbe._CHUNK)
    assert launched == [(chunks,), (chunks,)]  # grids the host knew: the batch's values in chunks


# ------------------------------------------------- the zoo's plain tables on the Triton TBE

BACKWARD_STEP = triton_tbe.backward_step  # before any test wraps it


def _zoo_fit(name: str, optimizer: dict, triton: bool, monkeypatch, accumulate: int = 1, graphs=None) -> tuple[torch.nn.Module, list]:
    import lightning.pytorch as pl
    from conftest import cpu_trainer, tiny_synthetic

    from lightning_hotcache._ops import step_graph
    from lightning_hotcache.embedding import torchrec_lookup
    from models import create_model

    steps: list[str] = []

    def counted(*args, **kwargs):
        steps.append(args[4])
        return BACKWARD_STEP(*args, **kwargs)

    monkeypatch.setattr(torchrec_lookup, "triton_pools_on", lambda device: triton)  # as on CUDA, in the interpreter
    monkeypatch.setattr(triton_tbe, "backward_step", counted)
    if graphs is not None:
        monkeypatch.setattr(step_graph, "graphs_for", lambda device: graphs)
    pl.seed_everything(0)
    dm = tiny_synthetic(batch_size=16, num_train_samples=88, num_val_samples=16)  # 5 batches and a short one
    model = create_model(name, dm.tables, dm.num_dense_features, embedding_optimizer=optimizer)
    cpu_trainer(max_epochs=1, accumulate_grad_batches=accumulate).fit(model, dm)
    return model, steps


@pytest.mark.parametrize(
    ("name", "optimizer", "accumulate", "triton_steps"),
    [
        ("dlrm", {"name": "rowwise_adagrad", "lr": 0.05}, 1, 6),
        pytest.param("deepfm", {"name": "sgd", "lr": 0.1}, 1, 12, marks=pytest.mark.full),  # two collections: dim 8, first-order weights
        pytest.param("dlrm", {"name": "adam", "lr": 0.01}, 1, 0, marks=pytest.mark.full),  # pooled by Triton, stepped as gradient rows
        # Two batches' gradients in a step: stepped as gradient rows, summed.
        pytest.param("dlrm", {"name": "rowwise_adagrad", "lr": 0.05}, 2, 0, marks=pytest.mark.full),
    ],
)
def test_the_zoos_tables_on_the_triton_tbe_train_what_the_pytorch_path_trains(name, optimizer, accumulate, triton_steps, monkeypatch) -> None:
    if DEVICE.type == "cuda":
        pytest.skip("on CUDA the zoo's tables run the Triton TBE by default: test_cuda.py compares them with the CPU")
    expected, none = _zoo_fit(name, optimizer, False, monkeypatch, accumulate)
    model, steps = _zoo_fit(name, optimizer, True, monkeypatch, accumulate)
    assert none == [] and len(steps) == triton_steps and set(steps) <= {optimizer["name"]}
    torch.testing.assert_close(model.state_dict(), expected.state_dict(), rtol=1e-5, atol=1e-6)
    state, expected_state = model.embedding_optimizer.state_tensors(), expected.embedding_optimizer.state_tensors()
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-6)


@pytest.mark.full
def test_the_zoos_triton_step_in_a_graph_trains_what_it_trains_eagerly(monkeypatch) -> None:
    from lightning_hotcache._ops.step_graph import StandInGraphs
    from lightning_hotcache.optim import rowwise

    if DEVICE.type == "cuda":
        pytest.skip("test_cuda.py records the graph on CUDA")
    monkeypatch.setattr(rowwise, "SORTS_WITH_REPEATS_ON", frozenset({"cuda", "cpu"}))
    optimizer = {"name": "rowwise_adagrad", "lr": 0.05}
    expected, _ = _zoo_fit("dlrm", optimizer, True, monkeypatch)
    graphs = StandInGraphs()
    model, steps = _zoo_fit("dlrm", optimizer, True, monkeypatch, graphs=graphs)
    assert graphs.captures == 1 and graphs.replays == 5 - 3 and len(steps) == 6
    for key, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
