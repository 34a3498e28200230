"""benchmarks/gpu.py in its CPU smoke mode: every strategy runs and reports what the GPU run will."""

from __future__ import annotations

import json
import math
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # appended: shadows nothing
import clock  # noqa: E402
import gpu  # noqa: E402
import report  # noqa: E402
from pieces import STAGING_PIECES, PieceClock  # noqa: E402

SMOKE = ["--device", "cpu", "--scale", "0.001", "--steps", "5", "--rounds", "1"]


def test_smoke_mode_reports_every_strategy(tmp_path, monkeypatch) -> None:
    # Each job in this process (the script gives every run a process of its own, seconds of
    # imports each); small batches, so that the 1% budget splits tables and rows move.
    def job_here(script, settings, name, wrapper=()):
        return gpu.main([*settings, "--job", name])

    monkeypatch.setattr(report, "job_in_process", job_here)
    out = tmp_path / "gpu.json"
    gpu.main([*SMOKE, "--batch-size", "64", "--out", str(out)])
    written = json.loads(out.read_text())
    # Where it ran: the processor by name and the SIMD level torch's CPU kernels dispatch to.
    capabilities = {"DEFAULT", "NO AVX", "AVX2", "AVX512", "SVE256", "VSX", "Z VECTOR"}  # get_cpu_capability's
    assert written["machine"]["cpu"] and written["machine"]["torch_cpu_capability"] in capabilities
    results = written["results"]
    assert list(results) == ["auto", "cpu-lookup", "hotcache@1", "hotcache@0.1", "hotcache@0.01"]
    assert all(r["samples_per_s"] > 0 and r["device_peak_bytes"] is None for r in results.values())
    assert all(r["setup_s"] > 0 and r["warmup_s"] > 0 for r in results.values())
    assert results["auto"]["hit_rate"] is None and results["auto"]["h2d_bytes_per_step"] == 0
    assert all(r["x_cpu-lookup"] > 0 for r in results.values())
    # FAE's baseline moves the pooled embeddings (64 samples x 26 features x 128 floats) each way.
    assert results["cpu-lookup"]["h2d_bytes_per_step"] == results["cpu-lookup"]["d2h_bytes_per_step"] == 64 * 26 * 128 * 4
    assert results["hotcache@1"]["hit_rate"] == 1.0
    assert "kernels" not in results["auto"] and all(r["kernels"] for name, r in results.items() if name.startswith("hotcache"))
    split = results["hotcache@0.01"]
    assert split["cache_device_bytes"] < split["table_bytes"]
    assert 0 < split["hit_rate"] < 1 and split["h2d_bytes_per_step"] > 0
    assert isinstance(split["caches_filling"], bool) and split["evicted_rows_per_step"] >= 0


def test_a_window_without_evictions_is_reported_as_a_filling_cache(capsys) -> None:
    """Rows fetched and fewer evicted (a full cache evicts one for each): the caches were
    still filling, wholly or partly; about as many evicted, or none fetched (everything on the
    device): a steady state."""
    assert clock.still_filling({"fetched_rows": 100, "evicted_rows": 0})
    assert clock.still_filling({"fetched_rows": 100, "evicted_rows": 60})
    assert not clock.still_filling({"fetched_rows": 100, "evicted_rows": 95})
    assert not clock.still_filling({"fetched_rows": 0, "evicted_rows": 0})
    assert clock.hit_rate_text({"hit_rate": None, "caches_filling": False}) == "-"  # no cache (auto)
    row = {"samples_per_s": 1.0, "x_auto": 1.0, "x_cpu-lookup": 1.0, "hit_rate": 0.9, "h2d_bytes_per_step": 0, "d2h_bytes_per_step": 0,
           "staging_wait_ms_per_step": 0.0, "device_peak_bytes": None, "peak_rss_mib": 1, "rounds": [1.0]}  # fmt: skip
    gpu.print_table({"hotcache@0.1": row | {"caches_filling": False}})
    assert "0.900 " in capsys.readouterr().out
    gpu.print_table({"hotcache@0.1": row | {"caches_filling": True}})
    printed = capsys.readouterr().out
    assert "0.900*" in printed and printed.rstrip().endswith(clock.FILLING_NOTE)


def test_the_lookahead_policy_runs_when_named(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(report, "job_in_process", lambda script, settings, name, wrapper=(): gpu.main([*settings, "--job", name]))
    out = tmp_path / "gpu.json"
    gpu.main([*SMOKE, "--batch-size", "64", "--strategies", "auto", "hotcache@0.01+lookahead", "--pieces", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    lookahead = results["hotcache@0.01+lookahead"]
    assert list(results) == ["auto", "hotcache@0.01+lookahead"] and 0 < lookahead["hit_rate"] < 1
    # --pieces: staging's pieces timed, each at most the whole of what holds it. The loader reads
    # the window ahead: the run has batches enough that the timed steps still announce theirs
    # (with a batch a step, the 64-batch window was read before the first step).
    pieces = lookahead["pieces_ms_per_batch"]
    assert list(pieces) == list(dict.fromkeys(name for name, _, _ in STAGING_PIECES)) and pieces["announce"] > 0
    assert 0 < pieces["begin acquire"] <= pieces["stage"] and 0 <= pieces["victims"] <= pieces["begin acquire"]
    assert not any(results["auto"]["pieces_ms_per_batch"].values())  # nothing staged
    assert gpu.strategies(gpu.parse_args(SMOKE))["hotcache@0.01+lookahead"]().cache_policy == "lookahead"


def test_staging_pieces_are_timed_while_entered_only() -> None:
    from lightning_hotcache.embedding.staging import Staging

    original = Staging.__dict__["announce"]
    with PieceClock() as pieces:
        assert Staging.__dict__["announce"] is not original and Staging.announce.__wrapped__ is original
    assert Staging.__dict__["announce"] is original and all(owner.__dict__[name] for _, owner, name in STAGING_PIECES)
    assert pieces.seconds() == dict.fromkeys((name for name, _, _ in STAGING_PIECES), 0.0)  # nothing staged


def test_the_kernel_asked_for_is_the_one_recorded() -> None:
    ran = gpu.main([*SMOKE, "--batch-size", "64", "--kernel", "pytorch", "--job", "hotcache@1"])
    assert ran["kernels"] == ["pytorch embedding_bag (kernel='pytorch' was chosen)"]


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--device", "cpu", "--steps", "5", "--warmup", "5"], "--warmup must be in"),
        (["--device", "cpu", "--strategies", "torchrec"], "unknown strategies"),
        (["--device", "cpu", "--device-memory", "8"], "--device-memory caps CUDA memory: it needs --device cuda"),
        (["--device", "cpu", "--steps", "5", "--warmup", "2", "--profile-steps", "4"], "needs --steps >= 6"),
        (["--device", "cpu", "--switch-interval", "0"], "--switch-interval is seconds, > 0"),
    ],
)
def test_bad_settings_are_clear_errors(argv, error, capsys) -> None:
    with pytest.raises(SystemExit):
        gpu.parse_args(argv)
    assert error in capsys.readouterr().err


def _dry_run(out: Path, **env_overrides: str):
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    if not (repo / ".venv" / "bin" / "python").exists():
        pytest.skip("the dry run uses the project's .venv (made by `make test`)")
    # In-process tests of DDP-based strategies leave rendezvous variables behind; a fresh run picks its own.
    stale = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "PL_GLOBAL_SEED"}
    env = {**{k: v for k, v in os.environ.items() if k not in stale}, "OUT": str(out), "GPU_DRY_RUN": "1", **env_overrides}
    return subprocess.run(["make", "-s", "gpu-check", "GPU_DRY_RUN=1"], cwd=repo, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.full  # every stage of `make gpu-check` on a CPU; the stage selection test below runs by default
def test_gpu_check_dry_run_runs_every_stage_and_reports_each(tmp_path) -> None:
    """`make gpu-check GPU_DRY_RUN=1`: the five stages the GPU machine runs (a 2-step fit, the
    CUDA tests, the benchmarks, the profile), here on the CPU, each reported in $OUT as it ends."""
    done = _dry_run(tmp_path)
    logs = "".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("stage*.log")))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:] + logs
    stages = (tmp_path / "stages.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in stages] == [
        "stage 1 imports-and-2-step-fit", "stage 2 cuda-tests", "stage 3 gpu-benchmark",
        "stage 4 tables-larger-than-the-gpu", "stage 5 profile",
    ]  # fmt: skip
    assert all(": rc 0," in line for line in stages), stages
    # Each stage may take its share and what the stages before it left unused, never the later ones' shares.
    limits = [int(line.split("(limit ")[1].split(" s)")[0]) for line in stages]
    # (bash's clock counts whole seconds: a stage may start one second later than it began)
    assert limits[0] in (29, 30) and all(limit >= share - 1 for limit, share in zip(limits, [30, 140, 220, 110, 45]))
    assert "torch" in (tmp_path / "stage1.log").read_text()
    assert "skipped" in (tmp_path / "stage2.log").read_text()  # found, and skipped without CUDA
    results = json.loads((tmp_path / "gpu.json").read_text())["results"]
    assert list(results) == [
        "auto", "auto+eager", "hotcache@0.1", "hotcache@0.01", "hotcache@0.01+eager", "hotcache@0.01+hostdir",
        "auto+bf16-mixed", "auto+fp32", "hotcache@0.01+lookahead",
    ]  # what stage 3 runs on the GPU  # fmt: skip
    assert results["auto"]["step_graph"] is None  # a CPU records no graph
    assert results["hotcache@0.01"]["pieces_ms_per_batch"]["stage"] > 0  # where the prefetch thread's time goes
    assert results["hotcache@0.01"]["staging"].startswith(("inline", "on a prefetch thread"))
    assert list(json.loads((tmp_path / "beyond_gpu.json").read_text())["results"]) == ["auto", "hotcache@0.1", "hotcache@0.01"]
    profiles = (tmp_path / "stage5.log").read_text()
    assert "## hotcache@0.1" in profiles and "## hotcache@0.01" in profiles
    assert '"benchmark": "row_copy"' in profiles and "put_rows x2" in profiles  # the host's write-backs, split or not
    assert '"benchmark": "triton_tbe"' in profiles and "forward+backward" in profiles  # the Triton TBE against what it replaces
    assert '"benchmark": "host_rows_in_place"' in profiles and "host file" in profiles  # rows stepped where they live
    assert '"benchmark": "device_directory"' in profiles and "admit+release ms" in profiles  # a batch's bookkeeping alone
    assert "announce+admit+release ms" in profiles  # and with the lookahead window's
    assert len(list(tmp_path.iterdir())) <= 8  # what one device call brings back, with room to read


def test_gpu_check_runs_the_stages_it_is_given_and_refuses_unknown_ones(tmp_path) -> None:
    done = _dry_run(tmp_path, GPU_CHECK_STAGES="1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    stages = (tmp_path / "stages.txt").read_text().splitlines()
    assert stages[0].startswith("stage 1 imports-and-2-step-fit: rc 0,")
    assert stages[0].endswith(("(limit 560 s)", "(limit 559 s)"))  # the shares of the stages left out go to the one run
    assert [line.split(":")[0] for line in stages[1:]] == [
        "stage 2 cuda-tests", "stage 3 gpu-benchmark", "stage 4 tables-larger-than-the-gpu", "stage 5 profile",
    ]  # fmt: skip
    assert all("skipped" in line for line in stages[1:])
    assert not (tmp_path / "gpu.json").exists() and not (tmp_path / "stage3.log").exists()
    refused = _dry_run(tmp_path / "refused", GPU_CHECK_STAGES="1 6")
    assert refused.returncode == 2 and "names stage '6'; the stages are 1 to 5" in refused.stderr


def test_gpu_wheel_set_fits_the_machine_with_the_repository() -> None:
    """`make gpu-wheels`' manifest names exactly the pins of requirements-gpu.txt, and those
    wheels plus every tracked file of the repository stay under the 64 MiB the lent machine
    takes (a pin that pulls a large wheel, such as fbgemm-gpu's CUDA build, fails here)."""
    import subprocess

    import gpu_wheels

    manifest = json.loads(gpu_wheels.MANIFEST.read_text())
    assert sorted(gpu_wheels.wheel_pin(name) for name in manifest) == sorted(gpu_wheels.pins().items()), (
        "benchmarks/gpu_wheels.json is out of date with requirements-gpu.txt: run `make gpu-wheels` and commit it"
    )
    assert all(name.endswith(("-any.whl", "x86_64.whl")) for name in manifest)
    repo = Path(__file__).resolve().parents[1]
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, text=True, check=True).stdout
    repo_bytes = sum((repo / path).stat().st_size for path in tracked.split("\0") if path and (repo / path).is_file())
    wheel_bytes = sum(entry["bytes"] for entry in manifest.values())
    assert wheel_bytes + repo_bytes < gpu_wheels.CARRY_LIMIT_BYTES, (wheel_bytes, repo_bytes)


def test_dry_run_hides_what_the_gpu_image_lacks() -> None:
    """The first GPU run lost stage 1 to the demo config's WandbLogger: the image has no wandb.
    The dry run's start-up hook hides such packages (import, find_spec and metadata alike) and
    leaves the image's and the wheel set's."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    probe = textwrap.dedent("""
        import importlib.metadata, importlib.util
        import torch, lightning, torchmetrics, numpy, torchrec, jsonargparse, lightning_hotcache
        assert importlib.util.find_spec("wandb") is None and importlib.util.find_spec("matplotlib") is None
        for name in ("wandb", "recbole"):
            try:
                importlib.metadata.version(name)
                raise SystemExit(f"{name} metadata visible")
            except importlib.metadata.PackageNotFoundError:
                pass
        try:
            import wandb
            raise SystemExit("wandb imported")
        except ModuleNotFoundError:
            pass
        from lightning.pytorch.loggers import WandbLogger
        try:
            WandbLogger(offline=True)
            raise SystemExit("WandbLogger made")
        except ModuleNotFoundError as err:
            print("refused:", err)
    """)
    env = {**os.environ, "PYTHONPATH": f"{repo}:{repo / 'benchmarks' / 'gpu_image'}"}
    done = subprocess.run([sys.executable, "-c", probe], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "refused: Requirement 'wandb" in done.stdout


def test_step_clock_times_the_window_after_warm_up() -> None:
    # It waits for the device only at the window's two ends (on CUDA), so it must find the last
    # batch itself: the epoch's, or max_steps'.
    import lightning.pytorch as pl
    from clock import StepClock, timed_trainer
    from conftest import tiny_synthetic

    from models import DLRM

    readings = []
    for max_steps, batches in ((5, 5), (8, 8)):  # stopped mid-epoch, and at its last batch
        pl.seed_everything(0)
        dm = tiny_synthetic(num_train_samples=8 * 32, batch_size=32)
        clock = StepClock(2, probe=lambda: readings.append(1) or len(readings))
        timed_trainer("auto", max_steps, clock).fit(DLRM(dm.tables, dm.num_dense_features), dm)
        assert clock.samples == (batches - 2) * 32
        assert (clock.at_start, clock.at_end) == (len(readings) - 1, len(readings))  # read at the two ends only
        assert clock.end > clock.start and clock.samples_per_s > 0


def test_a_run_that_does_not_fit_the_gpu_is_reported_as_such(monkeypatch, capsys) -> None:
    # Tables larger than the (capped) GPU: `auto` cannot hold them; the benchmark goes on and says so.
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 17.30 GiB\nmore detail")

    monkeypatch.setattr(gpu, "_train", out_of_memory)
    args = gpu.parse_args(SMOKE)
    result = gpu.train("auto", args)
    assert result["does_not_fit"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 17.30 GiB"
    assert math.isnan(result["samples_per_s"]) and result["device_memory_cap_bytes"] is None
    result |= {"rounds": [result["samples_per_s"]], "x_auto": float("nan"), "x_cpu-lookup": float("nan")}
    gpu.print_table({"auto": result})
    assert "does not fit" in capsys.readouterr().out


def test_profile_mode_prints_where_the_steps_time_goes(capsys) -> None:
    gpu.main([*SMOKE, "--batch-size", "64", "--warmup", "2", "--profile-steps", "2", "--strategies", "hotcache@0.1"])
    printed = capsys.readouterr().out
    assert "## hotcache@0.1" in printed and "# 2 steps from batch 2, by self_cpu_time_total" in printed
    assert "aten::" in printed  # the ops of the profiled steps


def test_staging_benchmark_stages_as_a_cuda_module_would(tmp_path, monkeypatch) -> None:
    # benchmarks/staging.py on a CPU: the host's share of GPU staging, with the directory a
    # CUDA module keeps (the dense id map; write-backs in flight; distinct reads left to the
    # device), split into the reader thread's part and the prefetch thread's.
    import staging

    from lightning_hotcache.cache.slot_map import DenseSlotMap

    built, original = [], staging.as_on_cuda

    def recorded(module) -> None:
        original(module)
        built.append(module)

    monkeypatch.setattr(staging, "as_on_cuda", recorded)
    out = tmp_path / "staging.json"
    staging.main(["--scale", "0.001", "--batch-size", "64", "--batches", "8", "--warmup", "2", "--budgets", "0.1", "0.01", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["hotcache@0.1", "hotcache@0.01"]
    assert all(r["staging_ms_per_batch"] > 0 and 0 < r["hit_rate"] < 1 and r["fetched_rows_per_batch"] > 0 for r in results.values())
    assert all(0 < r["reader_ms_per_batch"] < r["staging_ms_per_batch"] and 0 < r["prefetch_ms_per_batch"] < r["staging_ms_per_batch"]
               and r["prefetch_mean_ms_per_batch"] > 0 for r in results.values())  # fmt: skip
    split = [cache for module in built for cache in module._staging.caches.values() if not cache.identity]
    assert split and all(isinstance(cache.slot_map, DenseSlotMap) and cache.defers_write_backs for cache in split)
    assert not any(module._staging.sums_gradients for module in built)
    assert all(cache.window is None for cache in split)
    built.clear()
    staging.main(["--scale", "0.001", "--batch-size", "64", "--batches", "8", "--warmup", "2", "--budgets", "0.01", "--lookahead", "3",
                  "--pieces", "--out", str(out)])  # fmt: skip
    split = [cache for module in built for cache in module._staging.caches.values() if not cache.identity]
    assert split and all(cache.window is not None and len(cache.window) == 3 for cache in split)  # each batch announced 3 ahead
    pieces = json.loads(out.read_text())["results"]["hotcache@0.01"]["pieces_ms_per_batch"]
    assert 0 < pieces["begin acquire"] <= pieces["stage"] and pieces["announce"] > 0


def test_staging_benchmark_beside_python_reports_alternate_batches_apart(tmp_path, capsys) -> None:
    # --beside-python: every other timed batch staged while a thread runs Python (the training
    # loop's stand-in), reported apart with its ratio; what is staged does not change.
    import staging

    args = ["--scale", "0.001", "--batch-size", "64", "--batches", "10", "--warmup", "2", "--budgets", "0.01", "--forked-workers", "0"]
    plain, beside = tmp_path / "plain.json", tmp_path / "beside.json"
    staging.main([*args, "--out", str(plain)])
    staging.main([*args, "--beside-python", "--python-gap-us", "5", "--out", str(beside)])
    alone, both = json.loads(plain.read_text())["results"]["hotcache@0.01"], json.loads(beside.read_text())["results"]["hotcache@0.01"]
    assert "beside_python" not in alone
    assert (both["hit_rate"], both["fetched_rows_per_batch"]) == (alone["hit_rate"], alone["fetched_rows_per_batch"])
    apart = both["beside_python"]
    assert apart["python_calls"] > 0 and apart["staging_ms_per_batch"] > 0
    assert apart["x_alone"] == pytest.approx(apart["staging_ms_per_batch"] / both["staging_ms_per_batch"])
    with pytest.raises(SystemExit):  # one timed batch cannot alternate
        staging.main(["--scale", "0.001", "--batches", "3", "--warmup", "2", "--beside-python"])
    assert "needs --batches at least --warmup + 2" in capsys.readouterr().err


def test_python_loop_runs_only_while_on() -> None:
    import staging

    with staging.PythonLoop(gap_us=1) as loop:
        time.sleep(0.05)
        assert loop.calls == 0  # built off
        loop.on()
        time.sleep(0.05)
        loop.off()
        time.sleep(0.01)  # a call under way when switched off may still finish
        calls = loop.calls
        assert calls > 0
        time.sleep(0.05)
        assert loop.calls == calls
    assert not loop._thread.is_alive()


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_drawn_ahead_are_the_loaders_own(workers) -> None:
    # `--data memory` must train on exactly what the loader draws live, drawn here or by forked processes.
    data = {"scale": 0.001, "batch_size": 32, "num_train_samples": 100, "shuffle": False}
    live = gpu.SyntheticCTRDataModule(num_workers=0, **data)
    drawn = gpu.DrawnAheadDataModule(workers, **data)
    assert drawn.num_workers == 0  # the loader runs no workers: nothing left to draw
    live_batches, drawn_batches = list(live.train_dataloader()), list(drawn.train_dataloader())
    assert len(drawn_batches) == len(live_batches) == 4  # the last one short (4 samples)
    for ours, theirs in zip(drawn_batches, live_batches):
        assert torch.equal(ours.dense_features, theirs.dense_features) and torch.equal(ours.labels, theirs.labels)
        assert ours.sparse_features.keys() == theirs.sparse_features.keys()
        assert torch.equal(ours.sparse_features.values(), theirs.sparse_features.values())
        assert torch.equal(ours.sparse_features.lengths(), theirs.sparse_features.lengths())
    assert torch.equal(drawn.source("val").batch(0, 8).labels, live.source("val").batch(0, 8).labels)  # other splits live
    with pytest.raises(KeyError, match=r"samples \[0, 16\) are not a drawn batch"):
        drawn.source("train").batch(0, 16)


def test_batches_in_memory_or_drawn_live_stage_alike(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(report, "job_in_process", lambda script, settings, name, wrapper=(): gpu.main([*settings, "--job", name]))
    runs = {}
    for data in ("memory", "live"):
        out = tmp_path / f"{data}.json"
        gpu.main([*SMOKE, "--batch-size", "64", "--data", data, "--strategies", "hotcache@0.01", "--out", str(out)])
        written = json.loads(out.read_text())
        assert written["settings"]["data"] == data
        runs[data] = written["results"]["hotcache@0.01"]
    for key in ("hit_rate", "fetched_rows_per_step", "h2d_bytes_per_step", "d2h_bytes_per_step"):
        assert runs["memory"][key] == runs["live"][key], key


def test_the_switch_interval_is_set_in_each_run_and_recorded(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(report, "job_in_process", lambda script, settings, name, wrapper=(): gpu.main([*settings, "--job", name]))
    previous = sys.getswitchinterval()
    try:
        out = tmp_path / "gpu.json"
        gpu.main([*SMOKE, "--batch-size", "64", "--switch-interval", "0.0005", "--strategies", "hotcache@0.1", "--out", str(out)])
        assert json.loads(out.read_text())["settings"]["switch_interval"] == 0.0005
        assert sys.getswitchinterval() == pytest.approx(0.0005, rel=0.02)  # set in the run (here in this process)
    finally:
        sys.setswitchinterval(previous)


def test_gil_handover_benchmark_reports_each_interval_and_restores_python_s(tmp_path) -> None:
    import gil_handover

    previous, threads = sys.getswitchinterval(), torch.get_num_threads()
    out = tmp_path / "gil.json"
    written = gil_handover.main(["--calls", "5", "--reps", "1", "--intervals", "0.001", "0.0002", "--out", str(out)])
    results = written["results"]
    assert [(r["interval_ms"], r["work"]) for r in results] == [
        (1.0, "python calls"), (1.0, "one TorchScript call"), (0.2, "python calls"), (0.2, "one TorchScript call"),
    ]  # fmt: skip
    assert all(r["alone_ms"] > 0 and r["beside_python_ms"] > 0 for r in results)
    assert json.loads(out.read_text())["results"] == results
    assert sys.getswitchinterval() == previous and not [t for t in threading.enumerate() if t.name == "python-loop"]
    assert torch.get_num_threads() == threads
    with pytest.raises(SystemExit):
        gil_handover.main(["--intervals", "0"])
