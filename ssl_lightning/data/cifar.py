"""CIFAR-10 / CIFAR-100 (Krizhevsky, "Learning Multiple Layers of Features from Tiny Images",
2009) data modules reading either torchvision's format or an ImageFolder copy."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from torch.utils.data import Dataset
from torchvision import datasets

from ssl_lightning.data.base import SSLDataModule
from ssl_lightning.data.datasets import ImageFolderDataset
from ssl_lightning.data.transforms import EvalTransform, MultiViewTransform

Layout = Literal["folder", "torchvision"]


class CIFAR10DataModule(SSLDataModule):
    """CIFAR-10: 50,000 train / 10,000 test images of 32 px, 10 classes.

    The layout under ``root`` is detected: an ImageFolder copy ``root/train/<class>/*.jpg`` and
    ``root/test/<class>/*.jpg`` (like the shared CIFAR-10 JPEG tarball), else torchvision's
    ``root/cifar-10-batches-py`` (downloaded into ``root`` when ``download`` is true). The train
    split feeds pre-training and the kNN bank, the test split the kNN / probe queries.

    Args:
        root: Dataset directory (e.g. ``data/cifar10``).
        download: Let torchvision download the dataset into ``root`` if it is not there.
        **kwargs: Loader and transform arguments of :class:`SSLDataModule`.
    """

    num_classes = 10
    name = "CIFAR-10"
    torchvision_dataset: type[datasets.CIFAR10] = datasets.CIFAR10
    torchvision_folder = "cifar-10-batches-py"
    data_hint = (
        "Extract the JPEG copy with `mkdir -p data && tar -xzf ../shared/data/cifar10-jpeg.tar.gz "
        "-C data` and set root: data/cifar10, or set download: true."
    )

    def __init__(self, root: str = "data/cifar10", download: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.root = Path(root)
        self.download = download

    def layout(self) -> Layout:
        """``"folder"`` or ``"torchvision"``, whichever is found under ``root``.

        Raises:
            FileNotFoundError: neither layout is there and ``download`` is false.
        """
        if (self.root / "train").is_dir() and (self.root / "test").is_dir():
            return "folder"
        if (self.root / self.torchvision_folder).is_dir() or self.download:
            return "torchvision"
        raise FileNotFoundError(
            f"{self.name} not found under {self.root}: expected either an ImageFolder copy "
            f"{self.root}/train/<class>/*.jpg and {self.root}/test/<class>/*.jpg, or torchvision's "
            f"{self.root}/{self.torchvision_folder}. {self.data_hint}"
        )

    def prepare_data(self) -> None:
        if self.layout() == "torchvision" and self.download:
            for train in (True, False):
                self.torchvision_dataset(str(self.root), train=train, download=True)

    def _split(self, train: bool, transform: Any) -> Dataset:
        if self.layout() == "folder":
            folder = self.root / ("train" if train else "test")
            return ImageFolderDataset(folder, labeled=True, transform=transform,
                                      hint=self.data_hint, unreadable=self.unreadable)
        return self.torchvision_dataset(str(self.root), train=train, transform=transform)

    def build_train(self, transform: MultiViewTransform) -> Dataset:
        return self._split(True, transform)

    def build_eval(self, transform: EvalTransform) -> tuple[Dataset, Dataset]:
        return self._split(True, transform), self._split(False, transform)


class CIFAR100DataModule(CIFAR10DataModule):
    """CIFAR-100: as :class:`CIFAR10DataModule` with 100 classes (torchvision folder
    ``cifar-100-python``)."""

    num_classes = 100
    name = "CIFAR-100"
    torchvision_dataset = datasets.CIFAR100
    torchvision_folder = "cifar-100-python"
    data_hint = "Set download: true to fetch it with torchvision, or put an ImageFolder copy there."

    def __init__(self, root: str = "data/cifar100", download: bool = False, **kwargs: Any) -> None:
        super().__init__(root, download, **kwargs)
