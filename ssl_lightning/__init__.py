"""ssl_lightning: self-supervised learning methods for images as PyTorch Lightning modules.

Public names are re-exported here so configs can say ``class_path: SimCLR``, and so a user's
own training loop can say ``from ssl_lightning import NTXentLoss``. ``LIGHTNING_NAMESPACE`` says
whether the classes derive from ``pytorch_lightning`` or ``lightning.pytorch`` (_lightning.py).
"""

from ssl_lightning._lightning import NAMESPACE as LIGHTNING_NAMESPACE  # noqa: F401  (first)
from ssl_lightning.backbones import ResNet, SmallConvNet, TimmBackbone, TorchvisionBackbone, ViT
from ssl_lightning.callbacks import *  # noqa: F401,F403
from ssl_lightning.callbacks import __all__ as _callbacks
from ssl_lightning.cli.pretrain import PretrainResult, pretrain
from ssl_lightning.data import *  # noqa: F401,F403
from ssl_lightning.data import __all__ as _data
from ssl_lightning.evaluation import *  # noqa: F401,F403
from ssl_lightning.evaluation import __all__ as _evaluation
from ssl_lightning.losses import *  # noqa: F401,F403
from ssl_lightning.losses import __all__ as _losses
from ssl_lightning.methods import *  # noqa: F401,F403
from ssl_lightning.methods import __all__ as _methods

__version__ = "0.1.0"
__all__ = [
    "ResNet", "SmallConvNet", "TimmBackbone", "TorchvisionBackbone", "ViT",
    *_methods, *_callbacks, *_data, *_evaluation, *_losses,
]
__all__ += ["pretrain", "PretrainResult"]
