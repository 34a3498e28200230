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


def initial_state(rule: str, rows: int, dim: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``rule``'s per-row state as a run part-way through training has it (Adam: rows stepped
    zero to five times already)."""
    widths = RowWiseOptimizerConfig(name=rule).state_widths(dim)
    state = {name: torch.rand(rows, width, generator=generator) for name, width in widths.items()}
    if "exp_avg" in state:
        state["exp_avg"] = torch.randn(rows, dim, generator=generator) * 0.1
        state["exp_avg_sq"] *= 0.01
        state["step"] = torch.randint(0, 6, (rows, 1), generator=generator).float()
        state["exp_avg"][state["step"][:, 0] == 0] = state["exp_avg_sq"][state["step"][:, 0] == 0] = 0.0
    return state


def reference_step(rule, weight, state, grad, indices, offsets, bag_mean, per_sample, lr=0.05):
    """The PyTorch path: each value's gradient row summed per distinct row, then `step_rows`
    (``state``: the rule's arrays by name, as `initial_state` makes them)."""
    lengths = offsets.diff()
    bag_of_value = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    scale = torch.ones(indices.numel()) if per_sample is None else per_sample.clone()
    if bag_mean is not None:
        scale *= torch.where(bag_mean.bool(), 1.0 / lengths.clamp(min=1), torch.ones_like(lengths, dtype=torch.float32))[bag_of_value]
    rows, inverse = torch.unique(indices, return_inverse=True)
    summed = torch.zeros(rows.numel(), weight.shape[1]).index_add_(0, inverse, grad[bag_of_value] * scale[:, None])
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


RULES = ["sgd", "rowwise_adagrad", "adam"]


def test_the_kernels_keep_the_state_each_rule_keeps() -> None:
    for rule in RULES:
        assert triton_tbe._STATE_OF_RULE[rule] == tuple(RowWiseOptimizerConfig(name=rule).state_widths(8))


def backward_cases() -> list:
    """Every case x rule x pooling x weights; `make test` runs every case x rule with two of the
    four pooling and weight settings, turning with the rule (each setting meets each rule in a case)."""
    settings = [("sum", False), ("mixed", True), ("sum", True), ("mixed", False)]
    out = []
    for c, case in enumerate(CASES):
        for r, rule in enumerate(RULES):
            fast = {settings[(c + r) % 4], settings[(c + r + 1) % 4]}
            for pooling, weighted in settings:
                marks = () if (pooling, weighted) in fast else pytest.mark.full
                out.append(pytest.param(case, rule, pooling, weighted, marks=marks, id=f"{case}-{rule}-{pooling}-{'weighted' if weighted else 'unweighted'}"))
    return out


@pytest.mark.parametrize(("case", "rule", "pooling", "weighted"), backward_cases())
def test_backward_steps_each_distinct_row_as_the_pytorch_path(case, rule, pooling, weighted) -> None:
    table_rows, dim = CASES[case]["table_rows"], CASES[case]["dim"]
    batch = 6
    weight = torch.randn(sum(table_rows), dim, generator=torch.Generator().manual_seed(3))
    state = initial_state(rule, sum(table_rows), dim, torch.Generator().manual_seed(4))
    expected_weight, expected_state = weight.clone(), {k: v.clone() for k, v in state.items()}
    features = torch.arange(len(table_rows)).repeat_interleave(batch)
    bag_mean = None if pooling == "sum" else features % 2
    for step in range(3):  # rows stepped again read their stepped values and state
        indices, offsets, per_sample = stack_batch(table_rows, batch, max_len=5, seed=10 + step)
        per_sample = per_sample if weighted else None
        grad = torch.randn(offsets.numel() - 1, dim, generator=torch.Generator().manual_seed(20 + step))
        on = [t.to(DEVICE) if t is not None else None for t in (indices, offsets, bag_mean, per_sample, grad)]
        triton_weight, triton_state = weight.to(DEVICE), {k: v.to(DEVICE) for k, v in state.items()}
        triton_tbe.backward_step(
            triton_weight, on[4], on[0], on[1], rule, lr=0.05, eps=1e-10, state=triton_state, bag_mean=on[2], per_sample_weights=on[3]
        )
        weight, state = triton_weight.cpu(), {k: v.cpu() for k, v in triton_state.items()}
        reference_step(rule, expected_weight, expected_state, grad, indices, offsets, bag_mean, per_sample)
        torch.testing.assert_close(weight, expected_weight, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(state, expected_state, rtol=1e-6, atol=1e-6)


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
@pytest.mark.parametrize(
    ("rule", "tiers"),
    [("sgd", "device"), ("rowwise_adagrad", "device"), ("rowwise_adagrad", "device-and-host"), ("adam", "device-and-host")],
)
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
    state = initial_state(rule, 6, 8, generator)
    expected_weight, expected_state = weight.clone(), {k: v.clone() for k, v in state.items()}
    reference_step(rule, expected_weight, expected_state, grad, rows, offsets, None, None)
    if tiers == "device":
        stepped, stepped_state = weight.to(DEVICE), {k: v.to(DEVICE) for k, v in state.items()}
        triton_tbe.backward_step(stepped, grad.to(DEVICE), rows.to(DEVICE), offsets.to(DEVICE), rule, 0.05, 1e-10, state=stepped_state)
    else:  # rows 1, 3 and 5 live in the host array, as rows 0, 1 and 2 there
        on_host = rows % 2 == 1
        locations = torch.where(on_host, triton_tbe.location_of_host_row(rows // 2), rows)
        slots, slot_state = weight.clone().to(DEVICE), {k: v.clone().to(DEVICE) for k, v in state.items()}
        host = weight[1::2].clone().to(DEVICE)  # any memory the kernel reaches
        host_state = {k: v[1::2].clone().to(DEVICE) for k, v in state.items()}
        triton_tbe.backward_step(slots, grad.to(DEVICE), locations.to(DEVICE), offsets.to(DEVICE), rule, 0.05, 1e-10,
                                 state=slot_state, host_weight=host, host_state=host_state)  # fmt: skip
        stepped, stepped_state = slots.cpu(), {k: v.cpu() for k, v in slot_state.items()}
        stepped[1::2] = host.cpu()
        for key, value in host_state.items():
            stepped_state[key][1::2] = value.cpu()
    # The hot row's gradient is a sum of hundreds of rows, added in another order than the reference's.
    torch.testing.assert_close(stepped.cpu(), expected_weight, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close({k: v.cpu() for k, v in stepped_state.items()}, expected_state, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("rule", ["rowwise_adagrad", "adam"])
def test_the_module_trains_in_its_backward_as_the_pytorch_path(rule) -> None:
    table_rows, dim, batch = [40, 9], 8, 5
    weight = torch.randn(sum(table_rows), dim, generator=torch.Generator().manual_seed(7))
    widths = RowWiseOptimizerConfig(name=rule).state_widths(dim)
    expected_weight, expected_state = weight.clone(), {k: torch.zeros(sum(table_rows), w) for k, w in widths.items()}
    tbe = triton_tbe.TritonTableBatchedEmbedding(weight.clone().to(DEVICE), rule, lr=0.05, eps=1e-10)
    for step in range(2):
        indices, offsets, _ = stack_batch(table_rows, batch, max_len=4, seed=30 + step)
        upstream = torch.randn(offsets.numel() - 1, dim, generator=torch.Generator().manual_seed(40 + step))
        out = tbe(indices.to(DEVICE), offsets.to(DEVICE))
        torch.testing.assert_close(out.detach().cpu(), reference_pooled(expected_weight, indices, offsets, None, None), rtol=1e-6, atol=1e-6)
        (out * upstream.to(DEVICE)).sum().backward()
        reference_step(rule, expected_weight, expected_state, upstream, indices, offsets, None, None)
    torch.testing.assert_close(tbe.weight.detach().cpu(), expected_weight, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close({k: v.cpu() for k, v in tbe.state().items()}, expected_state, rtol=1e-6, atol=1e-6)


def test_unknown_rules_and_missing_state_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"apply sgd, rowwise_adagrad, adam, not 'adagrad'"):
        triton_tbe.TritonTableBatchedEmbedding(torch.zeros(2, 4, device=DEVICE), "adagrad", lr=0.1, eps=1e-8)
    weight, offsets = torch.zeros(2, 4, device=DEVICE), torch.tensor([0, 1], device=DEVICE)
    ids, grad = torch.zeros(1, dtype=torch.int64, device=DEVICE), torch.ones(1, 4, device=DEVICE)
    with pytest.raises(ValueError, match=r"adam needs the rows' exp_avg_sq and step"):
        triton_tbe.backward_step(weight, grad, ids, offsets, "adam", 0.1, 1e-8, {"exp_avg": torch.zeros(2, 4, device=DEVICE)})
    with pytest.raises(ValueError, match=r"rowwise_adagrad on rows read from the host needs the host rows' momentum"):
        triton_tbe.backward_step(weight, grad, ids, offsets, "rowwise_adagrad", 0.1, 1e-8, {"momentum": torch.zeros(2, 1, device=DEVICE)},
                                 host_weight=weight.clone())  # fmt: skip


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
    triton_tbe.backward_step(weight, grad, indices.to(DEVICE), offsets.to(DEVICE), "rowwise_adagrad", 0.1, 1e-10, {"momentum": momentum})
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
        pytest.param("dlrm", {"name": "adam", "lr": 0.01}, 1, 6, marks=pytest.mark.full),
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
