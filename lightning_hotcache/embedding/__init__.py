"""The hot/cold embedding module: a drop-in for torchrec's EmbeddingBagCollection.

`collection` is the module (a facade); `layout` says where rows live; `staging`, `lookup`
and `update` are the three parts of a step, chosen once per module; `plain` turns a trained
model back into TorchRec modules.
"""

from torch import nn

from lightning_hotcache.embedding.collection import HotColdEmbeddingBagCollection
from lightning_hotcache.embedding.plain import to_torchrec


def hot_cold_modules(model: nn.Module) -> dict[str, HotColdEmbeddingBagCollection]:
    """Module path -> every HotColdEmbeddingBagCollection in ``model``."""
    return {name: m for name, m in model.named_modules() if isinstance(m, HotColdEmbeddingBagCollection)}


__all__ = ["HotColdEmbeddingBagCollection", "hot_cold_modules", "to_torchrec"]
