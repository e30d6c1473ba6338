"""Self-supervised methods, each a LightningModule derived from SSLMethod."""

from ssl_lightning.methods.barlow_twins import BarlowTwins
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.simclr import SimCLR
from ssl_lightning.methods.simsiam import SimSiam
from ssl_lightning.methods.vicreg import VICReg

__all__ = ["SSLMethod", "SimCLR", "BarlowTwins", "SimSiam", "VICReg"]
