"""A data module for any image dataset stored as folders, labeled or not."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from torch.utils.data import Dataset

from ssl_lightning.data.arrays import load_array
from ssl_lightning.data.base import SSLDataModule, eval_splits
from ssl_lightning.data.datasets import (
    ImageFolderDataset,
    check_directory,
    class_folders,
    has_class_folders,
    load_image,
)
from ssl_lightning.data.indexing import ARRAY_EXTENSIONS, IMAGE_EXTENSIONS
from ssl_lightning.data.multichannel_device_views import ArrayImage, MultiChannelDeviceViews
from ssl_lightning.data.transforms import EvalTransform, MultiViewTransform, PresetName


class ImageFolderDataModule(SSLDataModule):
    """Pre-training on ``train_dir``, evaluation on the labeled splits available.

    ``train_dir`` is either labeled (``train_dir/<class>/<image>``) or unlabeled (a flat folder
    of images, or any tree of images with ``train_labeled: false``). Evaluation (kNN bank /
    queries):

    - labeled train + ``val_dir``: bank = train images, queries = ``val_dir`` images;
    - unlabeled train + ``val_dir``: the labeled ``val_dir`` is split in two halves, alternating
      over its sorted (class, file) list (even positions = bank, odd = queries), so both halves
      cover every class;
    - no ``val_dir``: no validation loaders (``val_dataloader`` returns ``[]``).

    Args:
        train_dir: Folder of training images.
        val_dir: Labeled folder ``val_dir/<class>/<image>`` for evaluation, or None.
        train_labeled: Read class folders of ``train_dir`` as labels; None detects it (labeled
            when ``train_dir`` holds only sub-folders, at least 2: a single folder carries no
            label). Unlabeled images get target -1.
        preset: ``"imagenet"`` (224 px) or ``"cifar"`` (32 px) default transforms.
        image_reader: ``"rgb"``: 8-bit RGB PIL images (the default transforms); ``"array"``:
            float ``(C, H, W)`` tensors of any channel count and bit depth in the files' units
            (TIFF, ``.npy``, 16-bit PNG; :mod:`ssl_lightning.data.arrays`), which need
            ``train_transform: MultiChannelViews`` (or the batched ``device_transform:
            MultiChannelDeviceViews``, whose default ``train_transform`` is ``ArrayImage()``)
            and ``eval_transform: MultiChannelEval`` with the data's per-channel mean and std
            (``python -m ssl_lightning channel-stats``).
        **kwargs: Loader and transform arguments of :class:`SSLDataModule`.

    Raises:
        ValueError: ``image_reader: array`` without its transforms, or with the RGB
            ``DeviceViews``; ``MultiChannelDeviceViews`` without ``image_reader: array``.
    """

    def __init__(
        self,
        train_dir: str,
        val_dir: str | None = None,
        train_labeled: bool | None = None,
        preset: PresetName = "imagenet",
        image_reader: Literal["rgb", "array"] = "rgb",
        **kwargs: Any,
    ) -> None:
        batched = isinstance(kwargs.get("device_transform"), MultiChannelDeviceViews)
        if image_reader == "array":
            if batched and kwargs.get("train_transform") is None:
                kwargs["train_transform"] = ArrayImage()
            problems = [f"missing: {name}" for name in ("train_transform", "eval_transform")
                        if kwargs.get(name) is None]
            device_transform = kwargs.get("device_transform")
            if device_transform is not None and not batched:
                problems.append(f"got device_transform: {type(device_transform).__name__}")
            if problems:
                raise ValueError(
                    "image_reader: array reads images of any channel count in their own units; "
                    "the RGB transforms do not apply to them. Set train_transform: "
                    "MultiChannelViews (or device_transform: MultiChannelDeviceViews, batched) "
                    "and eval_transform: MultiChannelEval with the data's mean and std (python "
                    "-m ssl_lightning channel-stats --images DIR), and no RGB device_transform "
                    f"({'; '.join(problems)}).")
        elif image_reader != "rgb":
            raise ValueError(f"image_reader must be 'rgb' or 'array', got {image_reader!r}.")
        elif batched:
            raise ValueError("device_transform: MultiChannelDeviceViews makes views of float "
                             "arrays; set image_reader: array to read the images as arrays.")
        super().__init__(preset=preset, **kwargs)
        self.loader = load_array if image_reader == "array" else load_image
        self.extensions = ARRAY_EXTENSIONS if image_reader == "array" else IMAGE_EXTENSIONS
        self.train_dir = Path(train_dir)
        self.val_dir = Path(val_dir) if val_dir is not None else None
        self.train_labeled = train_labeled

    @property
    def num_classes(self) -> int | None:  # type: ignore[override]
        """Class folders of ``val_dir`` (or of a labeled ``train_dir``); None if unlabeled."""
        folder = self.val_dir if self.val_dir is not None else self.train_dir
        if folder is self.train_dir and not self._train_is_labeled():
            return None
        return len(class_folders(check_directory(folder)))

    def _train_is_labeled(self) -> bool:
        folder = check_directory(self.train_dir)
        if self.train_labeled is False:
            return False
        classes = len(class_folders(folder))
        if self.train_labeled is None:
            return has_class_folders(folder) and classes > 1
        if classes < 2:
            raise ValueError(
                f"train_labeled: true, but {folder} has {classes} class folder(s): a probe on "
                "one class reports 100 %. Set train_labeled: false (or null) to pre-train on "
                "these images unlabeled, or give >= 2 class folders."
            )
        return True

    def build_train(self, transform: MultiViewTransform) -> Dataset:
        return self._dataset(self.train_dir, self._train_is_labeled(), transform)

    def build_eval(self, transform: EvalTransform) -> tuple[Dataset, Dataset] | None:
        if self.val_dir is None:
            return None
        val = self._dataset(self.val_dir, True, transform)
        train = self._dataset(self.train_dir, True, transform) if self._train_is_labeled() else None
        return eval_splits(val, train)

    def _dataset(self, folder: Path, labeled: bool, transform: Any) -> ImageFolderDataset:
        return ImageFolderDataset(folder, labeled=labeled, transform=transform,
                                  unreadable=self.unreadable, loader=self.loader,
                                  extensions=self.extensions)
