"""Every collective of the library runs on the device its process group's backend needs
(lightning_hotcache.distributed.collectives): CPU for gloo, the current CUDA device for NCCL."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

import lightning_hotcache
from lightning_hotcache.distributed import collectives

PACKAGE = Path(lightning_hotcache.__file__).parent
COLLECTIVE = re.compile(r"\bdist\.(all_to_all\w*|all_gather\w*|all_reduce\w*|broadcast\w*|reduce_scatter\w*|gather|scatter|reduce|send|recv)\(")


def test_no_collective_bypasses_the_device_helper() -> None:
    bypasses = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "collectives.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if COLLECTIVE.search(line)
    ]
    assert not bypasses, "call lightning_hotcache.distributed.collectives instead:\n" + "\n".join(bypasses)


def test_group_device_follows_the_backend(monkeypatch) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert collectives.group_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert collectives.group_device() == torch.device("cuda", 1)
