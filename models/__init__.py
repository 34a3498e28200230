"""The model zoo: CTR models as LightningModules on torchrec batches.

Every model's constructor starts ``(tables, num_dense_features, ...)`` with defaults for
the rest; `create_model` builds one by registry name.
"""

from typing import Any, Sequence

from torchrec import EmbeddingBagConfig

from models.base import CTRModel
from models.dcn import DCN
from models.deepfm import DeepFM
from models.dlrm import DLRM, DLRM_DCN
from models.finalmlp import FinalMLP
from models.fm import FM
from models.lr import LR
from models.wide_deep import WideAndDeep
from models.xdeepfm import XDeepFM

MODEL_REGISTRY: dict[str, type[CTRModel]] = {"dlrm": DLRM, "dlrm_dcn": DLRM_DCN, "deepfm": DeepFM, "dcn": DCN,
                                             "xdeepfm": XDeepFM, "finalmlp": FinalMLP, "lr": LR, "fm": FM,
                                             "wide_deep": WideAndDeep}  # fmt: skip


def create_model(name: str, tables: Sequence[EmbeddingBagConfig], num_dense_features: int, **kwargs: Any) -> CTRModel:
    """Build a zoo model by its registry name (see `MODEL_REGISTRY`)."""
    try:
        model_cls = MODEL_REGISTRY[name.lower()]
    except KeyError:
        raise ValueError(f"Unknown model {name!r}; the zoo has {', '.join(sorted(MODEL_REGISTRY))}.") from None
    return model_cls(tables, num_dense_features, **kwargs)


__all__ = ["CTRModel", "DCN", "DLRM", "DLRM_DCN", "DeepFM", "FM", "FinalMLP", "LR", "MODEL_REGISTRY", "WideAndDeep",
           "XDeepFM", "create_model"]  # fmt: skip
