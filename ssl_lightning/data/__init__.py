"""Data modules and multi-view transforms."""

from ssl_lightning.data.base import SSLDataModule
from ssl_lightning.data.byol_views import BYOLViews
from ssl_lightning.data.cifar import CIFAR10DataModule, CIFAR100DataModule
from ssl_lightning.data.datasets import CorruptImageError, ImageFolderDataset
from ssl_lightning.data.device_views import DeviceViews, UInt8Image
from ssl_lightning.data.gram_crops import GramCropViews
from ssl_lightning.data.image_folder import ImageFolderDataModule
from ssl_lightning.data.located_views import LocatedViews
from ssl_lightning.data.mae_views import MAEViews
from ssl_lightning.data.multichannel_device_views import ArrayImage, MultiChannelDeviceViews
from ssl_lightning.data.multichannel_views import MultiChannelEval, MultiChannelViews
from ssl_lightning.data.multicrop import MultiCropViews
from ssl_lightning.data.paka_views import PaKAViews
from ssl_lightning.data.segmented_views import FelzenszwalbViews
from ssl_lightning.data.streaming import StreamingDataModule
from ssl_lightning.data.transforms import (
    EvalTransform,
    LinearEvalTransform,
    MultiViewTransform,
    SimCLRViews,
    simclr_augmentation,
)

__all__ = [
    "SSLDataModule",
    "CIFAR10DataModule",
    "CIFAR100DataModule",
    "ImageFolderDataModule",
    "ImageFolderDataset",
    "StreamingDataModule",
    "CorruptImageError",
    "MultiViewTransform",
    "SimCLRViews",
    "LocatedViews",
    "FelzenszwalbViews",
    "BYOLViews",
    "MAEViews",
    "DeviceViews",
    "UInt8Image",
    "MultiCropViews",
    "PaKAViews",
    "MultiChannelViews",
    "MultiChannelEval",
    "MultiChannelDeviceViews",
    "ArrayImage",
    "GramCropViews",
    "EvalTransform",
    "LinearEvalTransform",
    "simclr_augmentation",
]
