"""Global batches split into per-process shares: coverage, padding, the loss weighting and device moves.

The 2-process training and validation runs that rest on these are in test_ddp.py
(`test_uneven_epoch_end_and_validation_match_one_process`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from datamodules.base import BatchDataset
from lightning_hotcache.distributed.global_batch import BatchShare, real_samples, share_bounds, share_mean
from conftest import tiny_synthetic


@pytest.mark.parametrize(("samples", "shares"), [(256, 2), (64, 2), (7, 3), (1, 2), (2, 4), (0, 1)])
def test_shares_are_consecutive_disjoint_and_even(samples: int, shares: int) -> None:
    bounds = [share_bounds(samples, shares, s) for s in range(shares)]
    assert bounds[0][0] == 0 and bounds[-1][1] == samples
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError, match="out of range"):
        share_bounds(samples, shares, shares)


@pytest.mark.parametrize(("samples", "batch_size", "shares"), [(2624, 128, 2), (2561, 128, 2), (1000, 100, 3), (5, 4, 4)])
def test_shares_of_an_epoch_read_each_sample_once_as_one_process_would(samples: int, batch_size: int, shares: int) -> None:
    """Per global batch, the shares' samples in share order are the one-process batch of
    batch_size x shares; an empty share holds one padding sample."""
    source = tiny_synthetic(num_train_samples=samples).source("train")
    one = BatchDataset(source, batch_size * shares)
    parts = [BatchDataset(source, batch_size, shares, share) for share in range(shares)]
    assert {len(p) for p in parts} == {len(one)}
    for k in range(len(one)):
        whole = one[k]
        pieces = [p[k] for p in parts]
        assert {(p.global_samples, p.num_shares) for p in pieces} == {(len(whole.labels), shares)}
        real = [p for p in pieces if p.padding == 0]
        assert all(len(p.labels) == 1 for p in pieces if p.padding == 1)
        assert all(p.padding in (0, 1) for p in pieces)
        torch.testing.assert_close(torch.cat([p.labels for p in real]), whole.labels)
        torch.testing.assert_close(torch.cat([p.dense_features for p in real]), whole.dense_features)
        ids = np.concatenate([p.sparse_features.values().numpy() for p in real])
        assert sorted(ids.tolist()) == sorted(whole.sparse_features.values().tolist())
        assert sum(real_samples(p) for p in pieces) == len(whole.labels)


@pytest.mark.parametrize("sizes", [(128, 128), (32, 32), (33, 32), (1, 0), (3, 2, 2, 2)])
def test_average_of_the_shares_losses_is_the_global_mean_and_padding_learns_nothing(sizes: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    total = sum(sizes)
    losses = torch.rand(total, dtype=torch.float64, requires_grad=True)
    shares, start = [], 0
    for size in sizes:
        padding = int(size == 0)
        piece = losses[start - padding : start + size]  # an empty share reads the last sample as padding
        batch = BatchShare(torch.zeros(len(piece), 1), None, torch.zeros(len(piece)), total, len(sizes), padding)
        shares.append(share_mean(piece, batch))
        start += size
    average = torch.stack(shares).mean()  # what DDP's gradient averaging amounts to
    torch.testing.assert_close(average, losses.mean())
    average.backward()
    torch.testing.assert_close(losses.grad, torch.full_like(losses, 1 / total))


def test_a_plain_batch_gets_the_plain_mean() -> None:
    batch = tiny_synthetic().source("train").batch(0, 8)
    losses = torch.rand(8)
    assert type(batch) is not BatchShare and real_samples(batch) == 8
    assert share_mean(losses, batch) == losses.mean()


def test_a_share_keeps_its_fields_when_lightning_moves_it() -> None:
    share = BatchDataset(tiny_synthetic(num_train_samples=300).source("train"), 128, 3, 2)[0]
    moved = move_data_to_device(share, torch.device("cpu"))
    assert isinstance(moved, BatchShare)
    assert (moved.global_samples, moved.num_shares, moved.padding) == (300, 3, 0)
    assert real_samples(moved) == 100


def test_a_mean_reducing_loss_fn_is_a_clear_error() -> None:
    # Issue 29 item 13: the usual nn.BCEWithLogitsLoss() (a mean) failed with an IndexError deep in share_mean.
    from conftest import cpu_trainer

    from models import DLRM

    dm = tiny_synthetic(num_train_samples=512, batch_size=64)
    model = DLRM(dm.tables, dm.num_dense_features)
    model.loss_fn = torch.nn.BCEWithLogitsLoss()
    with pytest.raises(ValueError, match=r"one loss per sample of the batch \(64\), got a loss of shape \(\).*reduction='none'"):
        cpu_trainer(max_steps=1, limit_val_batches=0).fit(model, dm)
    with pytest.raises(ValueError, match="one loss per sample"):
        share_mean(torch.rand(3), tiny_synthetic().source("train").batch(0, 8))  # a plain batch too
