"""Back to plain TorchRec modules: a model trained under ``hotcache`` as ``auto`` would hold it.

After `Trainer.fit` the model object still holds `HotColdEmbeddingBagCollection`s, whose rows
live in caches and host stores, run on locks and weak references, and check ids against the
data: fine for training, but torch.fx, TorchScript and torch.export cannot trace them, and a
serving stack expects TorchRec's `EmbeddingBagCollection`. `to_torchrec` swaps each one for
an `EmbeddingBagCollection` holding its current weights.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import EmbeddingBagCollection

from lightning_hotcache.embedding.collection import HotColdEmbeddingBagCollection, plain_collection


def to_torchrec(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Replace every `HotColdEmbeddingBagCollection` in ``model`` (at any depth, or ``model``
    itself) with a TorchRec `EmbeddingBagCollection` of the same tables and current weights on
    ``device`` (the CPU by default: the whole tables may not fit the accelerator), in place;
    returns the model (the new module when ``model`` itself was one).

    Across processes every rank must call it (the tables are gathered from the ranks' shards).
    The row-wise optimizer state stays behind: the result is for inference, export or a new
    run under another strategy (a checkpoint keeps the state, see `HotCacheStrategy`)."""
    if isinstance(model, HotColdEmbeddingBagCollection):
        return _plain(model, device)
    hot = [(name, m) for name, m in model.named_modules() if isinstance(m, HotColdEmbeddingBagCollection)]
    for name, module in hot:
        model.set_submodule(name, _plain(module, device))
    return model


def _plain(module: HotColdEmbeddingBagCollection, device: torch.device | str) -> EmbeddingBagCollection:
    return plain_collection(module.embedding_bag_configs(), module.is_weighted(), module.state_dict(), device)
