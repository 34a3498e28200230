"""LR: logistic regression over the sparse ids and the dense features, the CTR baseline."""

from __future__ import annotations

from models.base import CTRModel


class LR(CTRModel):
    """Logistic regression: ``sigmoid(w0 + <w_dense, x> + sum over sparse features of w[id])``.

    The first-order term alone (`models.first_order.FirstOrderArch`): the model has no dim-D
    tables, so the datamodule's ``embedding_dim`` goes unused.

    Args:
        tables: the datamodule's embedding tables (the rows and features of the per-id weights).
        num_dense_features: width of the dense input.
        **kwargs: `CTRModel` options (embedding_optimizer, dense_lr, dense_weight_decay, embedding_l2).
    """

    uses_embeddings = False
    uses_first_order = True
