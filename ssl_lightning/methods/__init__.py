"""Self-supervised methods, each a LightningModule derived from SSLMethod."""

from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.simclr import SimCLR

__all__ = ["SSLMethod", "SimCLR"]
