"""Back to plain TorchRec modules: a model trained under ``hotcache`` as ``auto`` would hold it.

After `Trainer.fit` the model object still holds `HotColdEmbeddingBagCollection`s, whose rows
live in caches and host stores, run on locks and weak references, and check ids against the
data: fine for training, but torch.fx, TorchScript and torch.export cannot trace them, and a
serving stack expects TorchRec's `EmbeddingBagCollection`. `to_torchrec` swaps each one for
an `EmbeddingBagCollection` holding its current weights.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch import nn
from torchrec import EmbeddingBagCollection

from lightning_hotcache.embedding.collection import HotColdEmbeddingBagCollection, plain_collection


def to_torchrec(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Replace every `HotColdEmbeddingBagCollection` in ``model`` (at any depth, or ``model``
    itself) with a TorchRec `EmbeddingBagCollection` of the same tables and current weights on
    ``device`` (the CPU by default: the whole tables may not fit the accelerator), in place;
    returns the model (the new module when ``model`` itself was one).

    Across processes every rank must call it, after ``fit`` (the tables are gathered from the
    ranks' shards, a collective): not under ``if trainer.is_global_zero:``, where rank 0 would
    wait for ranks that never come; call it on every rank, then save or export on rank 0. During
    a fit it is refused (the fit still trains the modules it would replace); ``copy.deepcopy``
    gives a copy with TorchRec tables and leaves the model training.
    The row-wise optimizer state stays behind: the result is for inference, export or a new
    run under another strategy (a checkpoint keeps the state, see `HotCacheStrategy`)."""
    _refuse_during_fit(model)
    if isinstance(model, HotColdEmbeddingBagCollection):
        return _plain(model, device)
    hot = [(name, m) for name, m in model.named_modules() if isinstance(m, HotColdEmbeddingBagCollection)]
    for name, module in hot:
        model.set_submodule(name, _plain(module, device))
    return model


def _refuse_during_fit(model: nn.Module) -> None:
    if not isinstance(model, pl.LightningModule):
        return
    try:
        trainer = model.trainer
    except RuntimeError:  # not attached to a Trainer
        return
    if trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING:
        raise RuntimeError(
            "to_torchrec replaces the model's hotcache tables in place, and this fit is still training them (its "
            "next step would run on plain TorchRec tables the strategy does not train). Call it after trainer.fit "
            "returns, on every rank; for a copy during training (EMA, a snapshot to export) use copy.deepcopy(model), "
            "whose tables are TorchRec's (also on every rank)."
        )


def _plain(module: HotColdEmbeddingBagCollection, device: torch.device | str) -> EmbeddingBagCollection:
    return plain_collection(module.embedding_bag_configs(), module.is_weighted(), module.state_dict(), device)
