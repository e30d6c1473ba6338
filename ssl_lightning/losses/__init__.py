"""Pure loss modules: embeddings in, scalar out. A loss never reads the trainer."""

from ssl_lightning.losses.nt_xent import NTXentLoss

__all__ = ["NTXentLoss"]
