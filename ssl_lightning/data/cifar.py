"""CIFAR-10 / CIFAR-100 (Krizhevsky, "Learning Multiple Layers of Features from Tiny Images",
2009) data modules reading either torchvision's format or an ImageFolder copy, obtained from a
local archive or torchvision's download when it is not there yet."""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import zipfile
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Literal

from torch.utils.data import Dataset
from torchvision import datasets

from ssl_lightning._lightning import rank_zero_info, rank_zero_warn
from ssl_lightning.data.base import SSLDataModule
from ssl_lightning.data.datasets import ImageFolderDataset
from ssl_lightning.data.transforms import EvalTransform, MultiViewTransform

Layout = Literal["folder", "torchvision"]

#: Prefix of the temporary folder beside ``root`` that an archive is extracted into.
EXTRACTING = ".extracting-"
#: Default limit (MB) on the bytes an archive expands to (``archive_max_mb``); CIFAR-10 and
#: CIFAR-100 expand to under 200 MB in either layout.
ARCHIVE_MAX_MB = 4096.0
#: Limit on an archive's expansion ratio (bytes extracted per byte of archive): images and
#: pickled arrays compress about 1:1, a "zip bomb" by a thousand and more.
ARCHIVE_MAX_RATIO = 100.0


def _member_problem(name: str, is_file_or_dir: bool) -> str | None:
    """Why an archive member may not be extracted, or None when it may."""
    if name.startswith(("/", "\\")) or PureWindowsPath(name).drive:
        return "is an absolute path"
    if ".." in PurePosixPath(name.replace("\\", "/")).parts:
        return "has a '..' component"
    if not is_file_or_dir:
        return "is a link or a device, not a file or folder"
    return None


def _unpack(archive: Path, destination: Path, max_bytes: int) -> None:
    """Extract a tar (any compression) or zip ``archive`` into ``destination``, refusing
    members with absolute paths, ``..`` components, links and devices, and archives that
    expand past ``max_bytes`` or :data:`ARCHIVE_MAX_RATIO` (checked on the member sizes before
    anything is written: a tar member's size is its exact length, and ``zipfile`` stops a zip
    member at its recorded size).

    Raises:
        ValueError: ``archive`` is not a tar or zip file, holds such a member or is too large.
    """
    if tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tar:
            members = [(m.name, m.isfile() or m.isdir()) for m in tar.getmembers()]
            _check_members(archive, members)
            _check_size(archive, sum(m.size for m in tar.getmembers() if m.isfile()), max_bytes)
            if hasattr(tarfile, "data_filter"):
                tar.extractall(destination, filter="data")
            else:  # Python < 3.10.12: the members were checked above
                tar.extractall(destination)
    elif zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zipped:
            _check_members(archive, [(info.filename, True) for info in zipped.infolist()])
            _check_size(archive, sum(info.file_size for info in zipped.infolist()), max_bytes)
            zipped.extractall(destination)
    else:
        raise ValueError(f"archive {archive} is neither a tar nor a zip file: give a .tar.gz, "
                         ".tar or .zip of the train/ and test/ folders.")


def _check_size(archive: Path, total: int, max_bytes: int) -> None:
    """Refuse an archive whose members add up to more than ``max_bytes``, or more than
    :data:`ARCHIVE_MAX_RATIO` times the archive's own size."""
    size = archive.stat().st_size
    if total > max_bytes or total > ARCHIVE_MAX_RATIO * max(size, 1):
        raise ValueError(
            f"archive {archive} ({size:,} bytes) expands to {total:,} bytes, past the limit of "
            f"{max_bytes:,} bytes (archive_max_mb) or {ARCHIVE_MAX_RATIO:g} times its size: "
            "refusing to extract it. If you trust it, raise --data.archive_max_mb, or extract "
            "it yourself (tar xf / unzip into a new folder) and set root to the folder.")


def _check_members(archive: Path, members: list[tuple[str, bool]]) -> None:
    for name, is_file_or_dir in members:
        problem = _member_problem(name, is_file_or_dir)
        if problem is not None:
            raise ValueError(f"archive {archive}: member {name!r} {problem}; refusing to "
                             "extract it. Use an archive of plain files and folders only.")


class CIFAR10DataModule(SSLDataModule):
    """CIFAR-10: 50,000 train / 10,000 test images of 32 px, 10 classes.

    The layout under ``root`` is detected: an ImageFolder copy ``root/train/<class>/*.jpg`` and
    ``root/test/<class>/*.jpg`` (like the shared CIFAR-10 JPEG tarball), else torchvision's
    ``root/cifar-10-batches-py``. When neither is there, ``prepare_data`` (rank 0 of each node;
    the other ranks wait) extracts ``archive`` into ``root``, else lets torchvision download the
    dataset into ``root`` when ``download`` is true. The train split feeds pre-training and the
    kNN bank, the test split the kNN / probe queries.

    The archive is extracted into a temporary folder beside ``root`` (``.<root
    name>.extracting-*``), which is renamed to ``root`` once complete, so an interrupted
    extraction never leaves a ``root`` that looks complete; the next run extracts again.

    Args:
        root: Dataset directory (e.g. ``data/cifar10``).
        download: Let torchvision download the dataset into ``root`` if it is not there.
        archive: A ``.tar.gz`` / ``.tar`` / ``.zip`` holding either layout, at its top level or
            in one top-level folder (the shared ``cifar10-jpeg.tar.gz`` holds ``cifar10/train``
            and ``cifar10/test``), extracted into ``root`` if no data is there yet.
        archive_max_mb: The most megabytes (10**6 bytes) the archive may expand to; an archive
            that expands to more, or to more than :data:`ARCHIVE_MAX_RATIO` times its own size,
            is refused before anything is written.
        **kwargs: Loader and transform arguments of :class:`SSLDataModule`.
    """

    num_classes = 10
    name = "CIFAR-10"
    torchvision_dataset: type[datasets.CIFAR10] = datasets.CIFAR10
    torchvision_folder = "cifar-10-batches-py"
    data_hint = ("Set archive: PATH (--data.archive, a .tar.gz / .tar / .zip of the train/ and "
                 "test/ folders), or download: true.")

    def __init__(self, root: str = "data/cifar10", download: bool = False,
                 archive: str | None = None, archive_max_mb: float = ARCHIVE_MAX_MB,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not archive_max_mb > 0 or archive_max_mb == float("inf"):
            raise ValueError(f"archive_max_mb must be a positive number of megabytes, got "
                             f"{archive_max_mb}.")
        self.root = Path(root)
        self.download = download
        self.archive = Path(archive) if archive is not None else None
        self.archive_max_mb = archive_max_mb

    def _found(self, folder: Path) -> Layout | None:
        """The layout of the data under ``folder``, or None when there is none."""
        if (folder / "train").is_dir() and (folder / "test").is_dir():
            return "folder"
        if (folder / self.torchvision_folder).is_dir():
            return "torchvision"
        return None

    def layout(self) -> Layout:
        """``"folder"`` or ``"torchvision"``, whichever is found under ``root``
        (``"torchvision"`` when none is and ``download`` is true).

        Raises:
            FileNotFoundError: neither layout is there and ``download`` is false; the message
                names the three ways to get the data.
        """
        found = self._found(self.root)
        if found is not None:
            return found
        if self.download:
            return "torchvision"
        archive = (f" (archive {self.archive} is set: call prepare_data() to extract it)"
                   if self.archive is not None else "")
        raise FileNotFoundError(
            f"{self.name} not found under {self.root}{archive}: expected either an ImageFolder "
            f"copy {self.root}/train/<class>/*.jpg and {self.root}/test/<class>/*.jpg, or "
            f"torchvision's {self.root}/{self.torchvision_folder}. Get it with archive: PATH "
            "(--data.archive, a .tar.gz / .tar / .zip of either layout, extracted into root), "
            "a root that holds it, or set download: true."
        )

    def prepare_data(self) -> None:
        """Extract ``archive`` or download the dataset when ``root`` has no data yet."""
        found = self._found(self.root)
        if found is None and self.archive is not None:
            self.extract()
        elif found != "folder" and self.download:
            for train in (True, False):
                self.torchvision_dataset(str(self.root), train=train, download=True)
        else:
            self.layout()  # raises when there is no data

    def extract(self) -> None:
        """Extract ``archive`` into ``root`` through a temporary folder beside it.

        Raises:
            FileNotFoundError: the archive does not exist.
            ValueError: it is no tar / zip file, has a hostile member or holds neither layout.
            FileExistsError: ``root`` exists, holds no data and is not empty.
        """
        archive = self.archive
        if archive is None or not archive.is_file():
            raise FileNotFoundError(f"archive {archive} does not exist: give the path of a "
                                    f".tar.gz / .tar / .zip of {self.name}.")
        if self.root.exists() and any(self.root.iterdir()):
            raise FileExistsError(
                f"{self.root} exists and is not empty but holds no {self.name}: refusing to "
                f"extract {archive} into it. Choose another root, or empty it.")
        parent = self.root.parent
        parent.mkdir(parents=True, exist_ok=True)
        prefix = f".{self.root.name}{EXTRACTING}"
        stale = sorted(p.name for p in parent.glob(f"{prefix}*"))
        if stale:
            rank_zero_warn(f"{parent} holds {', '.join(stale)}, left by an interrupted "
                           "extraction (or one running now); remove it when none runs.")
        rank_zero_info(f"Extracting {archive} into {self.root} ...")
        staging = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        try:
            _unpack(archive, staging, int(self.archive_max_mb * 1e6))
            data = next((folder for folder in (staging, *sorted(staging.iterdir()))
                         if folder.is_dir() and self._found(folder) is not None), None)
            if data is None:
                top = sorted(p.name for p in staging.iterdir())
                raise ValueError(
                    f"archive {archive} holds no {self.name} (its top level: {top}): expected "
                    f"train/ and test/ folders or {self.torchvision_folder}/, at the top or in "
                    "one top-level folder.")
            try:
                os.rename(data, self.root)  # atomic; replaces only an empty root
            except OSError:
                if self._found(self.root) is None:  # not another run's finished extraction
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)

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

    def __init__(self, root: str = "data/cifar100", download: bool = False,
                 archive: str | None = None, archive_max_mb: float = ARCHIVE_MAX_MB,
                 **kwargs: Any) -> None:
        super().__init__(root, download, archive, archive_max_mb, **kwargs)
