"""Shared fixtures: tiny synthetic data and quiet CPU trainers."""

from __future__ import annotations

import os
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Without a GPU, Triton's kernels run on CPU tensors in its interpreter, so their tests and
# kernel="triton" fits run here. Set before torch and Lightning are imported: Triton reads it
# when it is imported (torch's compiler imports it) and when a kernel is defined.
if not any(os.path.exists(path) for path in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version")):
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter_shims import install as install_interpreter_shims

    install_interpreter_shims()

import lightning.pytorch as pl  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def tiny_synthetic(**overrides: Any):
    """A SyntheticCTRDataModule small enough for a unit test (tables of at most 200 rows)."""
    from datamodules import SyntheticCTRDataModule

    settings: dict[str, Any] = dict(
        scale=0.001,
        num_embeddings_cap=200,
        num_train_samples=4096,
        num_val_samples=2048,
        num_test_samples=1024,
        batch_size=256,
        embedding_dim=8,
        shuffle=False,
    )
    settings.update(overrides)
    return SyntheticCTRDataModule(**settings)


class UserModel(pl.LightningModule):
    """A user's own LightningModule with TorchRec tables, not a zoo model: only the strategies'
    own checks stand between it and a fit."""

    def __init__(self, tables: Any) -> None:
        from torchrec import EmbeddingBagCollection

        super().__init__()
        self.tables = EmbeddingBagCollection(tables=tables)
        self.head = torch.nn.Linear(len(tables) * tables[0].embedding_dim, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.head(self.tables(batch.sparse_features).values()).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def forced_staging(reader_thread: bool = False, step_priority: bool = False, **options: Any):
    """A HotCacheStrategy that runs, on a CPU, staging the device chooses otherwise: a reader
    thread beside the prefetch thread (CUDA's), or staging threads at the step's priority
    (CUDA's). Both paths are the same code on every device; tests run them here."""
    from lightning_hotcache import HotCacheStrategy

    class ForcedStaging(HotCacheStrategy):
        @property
        def uses_reader_thread(self) -> bool:
            return self.uses_prefetch_thread and reader_thread

        @property
        def stages_in_background(self) -> bool:
            return super().stages_in_background and not step_priority

    return ForcedStaging(**options)


def cpu_trainer(**overrides: Any) -> pl.Trainer:
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    settings.update(overrides)
    return pl.Trainer(**settings)


@pytest.fixture(scope="session")
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict]:
    """``trained(run)``: what rank 0 of a planned run (tests/launch.py's `planned`) saved. The
    first test asking for a run of N processes launches every planned run of N processes that a
    selected test uses, together (one launch, ~10 s of imports per rank, for all of them). Read
    only: the dicts are shared."""
    from launch import PLANNED, Run, train_together

    selected = {getattr(item, "originalname", item.name) for item in request.session.items}
    results: dict[Run, dict | str] = {}

    def result(run: Run) -> dict:
        if run not in results:
            wanted = [r for r in PLANNED if r.devices == run.devices and r.used_by in selected and r not in results]
            together = list(dict.fromkeys([run, *wanted]))  # equal runs planned by several tests train once
            try:
                results.update(train_together(tmp_path_factory.mktemp(f"together{run.devices}"), together))
            except Exception as error:  # a launch that failed or hung fails its runs' tests once, not each again
                results.update({r: f"their launch failed: {error}" for r in together})
        found = results[run]
        if isinstance(found, str):
            pytest.fail(f"the planned run {run.options} did not train:\n{found}")
        return found

    return result


@pytest.fixture
def synthetic_factory():
    return tiny_synthetic


def mappings_at(tensor: torch.Tensor) -> tuple[dict[str, int], set[str]]:
    """Summed /proc/self/smaps fields (KiB) and the VmFlags of the mappings that overlap
    ``tensor``'s memory (advising a range splits a mapping at its 2 MiB boundaries, so the
    array spans several)."""
    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size()
    fields: dict[str, int] = {}
    flags: set[str] = set()
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < last and first < end
        elif inside and head == "VmFlags:":
            flags.update(line.split()[1:])
        elif inside and line.endswith(" kB"):
            fields[head.rstrip(":")] = fields.get(head.rstrip(":"), 0) + int(line.split()[1])
    return fields, flags


def flip_largest_tensor(file: Path) -> None:
    """4 bytes inverted in the middle of the largest tensor of ``file`` (a torch.save archive),
    as a bad disk or copy leaves it: the file still loads, with other numbers."""
    with zipfile.ZipFile(file) as archive:
        record = max(archive.infolist(), key=lambda info: info.file_size)
    with open(file, "r+b") as f:
        f.seek(record.header_offset + 26)  # the zip local header's name and extra field lengths
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        f.seek(record.header_offset + 30 + name_length + extra_length + record.file_size // 2)
        data = f.read(4)
        f.seek(-4, os.SEEK_CUR)
        f.write(bytes(byte ^ 0xFF for byte in data))


def covering_rows(*factors: list) -> list[tuple]:
    """Rows over ``factors`` in which every pair of values of two factors appears at least once
    (a pairwise covering array, built greedily: each row the one covering most pairs not yet seen)."""
    import itertools

    def pairs(row: tuple) -> set:  # and each value alone, so that one factor is covered too
        pairs = {((i, row[i]), (j, row[j])) for i, j in itertools.combinations(range(len(row)), 2)}
        return pairs | {((i, value),) for i, value in enumerate(row)}

    candidates = list(itertools.product(*factors))
    wanted = set().union(*map(pairs, candidates))
    rows: list[tuple] = []
    while wanted:
        def covered(row: tuple) -> set:
            return pairs(row) & wanted

        best = max(candidates, key=lambda row: len(covered(row)))
        wanted -= covered(best)
        rows.append(best)
    return rows


def exactness_matrix(names: list[str], together: dict[str, list], apart: dict[str, list]) -> list:
    """The cases of a test over ``together`` x ``apart``, as ``pytest.param``s in the order of
    ``names``. `make test` runs the full product of the factors that interact (``together``)
    with rows of the others (``apart``) that cover each of their pairs; every other case is
    marked ``full`` (`make test-all` runs them)."""
    import itertools

    apart_rows = covering_rows(*apart.values())
    together_rows = list(itertools.product(*together.values()))
    fast = set()
    for k in range(max(len(together_rows), len(apart_rows))):
        fast.add(together_rows[k % len(together_rows)] + apart_rows[k % len(apart_rows)])
    keys = [*together, *apart]
    cases = []
    for row in itertools.product(*together.values(), *apart.values()):
        values = dict(zip(keys, row))
        ordered = tuple(values[name] for name in names)
        cases.append(pytest.param(*ordered, marks=() if row in fast else pytest.mark.full))
    return cases
