"""Pre-training on litdata shards (``python -m ssl_lightning shard``), with exact resume.

The shards are read map-style: each shard folder is a litdata ``StreamingDataset`` indexed by
position, and the samples are visited in :class:`~ssl_lightning.data.seeding.EpochSampler`'s
order through the stateful loader of :class:`~ssl_lightning.data.base.SSLDataModule`. litdata's
own ``StreamingDataLoader`` assigns chunks to loader workers, so its sample order changes with
the number of workers; here the order and the views are pure functions of (seed, epoch, index,
view), the same for any number of workers and processes, and a run stopped mid-epoch resumes
bit-identically (see ``docs/streaming.md``).
"""

from __future__ import annotations

import inspect
import io
from pathlib import Path
from typing import Any

from PIL import Image
from torch.utils.data import Dataset

from ssl_lightning.data.base import SSLDataModule, eval_splits
from ssl_lightning.data.datasets import (
    UNLABELED,
    CorruptImageError,
    ReplacingDataset,
    UnreadableImages,
    load_image,
)
from ssl_lightning.data.shard_manifest import (
    LITDATA_INDEX,
    ShardError,
    read_manifest,
    verify_shards,
)
from ssl_lightning.data.shard_paths import index_file_problem
from ssl_lightning.data.shard_source import RemoteShards, is_url
from ssl_lightning.data.transforms import EvalTransform, MultiViewTransform, PresetName


class ShardDataset(ReplacingDataset):
    """The images of a shard folder, decoded to RGB PIL images, in the source folder's order.

    The folder is checked against its manifest when the dataset is made
    (:func:`~ssl_lightning.data.shard_manifest.verify_shards`); each process (and loader
    worker) opens the shards it reads lazily. An image whose bytes cannot be decoded follows
    ``unreadable`` (:class:`~ssl_lightning.data.datasets.UnreadableImages`), as in an image
    folder; the sample is named ``<folder>/<shard>#<position> (<source path>)``. A folder at a
    URL (:mod:`~ssl_lightning.data.shard_source`) is checked against the manifest and the
    shards' litdata indexes, fetched into its cache; a shard's chunks are fetched (and checked
    against the manifest's SHA-256) when a process first opens the shard, before litdata reads
    them from the cache. A shard whose index names a serializer that could run code, or a
    chunk outside its folder, is refused when opened
    (:mod:`~ssl_lightning.data.shard_paths`); a chunk litdata cannot read is a
    :class:`ShardError` naming the shard, the chunk and the fix.

    Args:
        root: The shard folder (holding ``manifest.json``): a path or a URL litdata reads.
        labeled: Use the manifest's labels (False: every target -1).
        transform: Applied to the PIL image.
        unreadable: What an undecodable image does (None: raise).
        checksums: Also compare the SHA-256 of every shard file with the manifest (at a URL:
            downloads every file).
        cache_dir: Parent of a URL's cache folder (None: ``~/.cache/ssl_lightning/shards``).

    Raises:
        FileNotFoundError: no manifest.
        ShardError: a missing, truncated or mismatched shard, named.
    """

    def __init__(self, root: str | Path, labeled: bool = True,
                 transform: Any | None = None, unreadable: UnreadableImages | None = None,
                 checksums: bool = False, cache_dir: str | Path | None = None) -> None:
        self.remote = RemoteShards(str(root), cache_dir) if is_url(root) else None
        self.root: str | Path = self.remote.url if self.remote is not None else Path(root)
        self.manifest = verify_shards(self.remote or self.root, checksums)
        self.labeled = labeled and bool(self.manifest["classes"])
        self.classes: list[str] = list(self.manifest["classes"]) if self.labeled else []
        self.transform = transform
        self.unreadable = unreadable if unreadable is not None else UnreadableImages()
        self.loader = self._read
        super().__init__()
        shards = self.manifest["shards"]
        self._names = [entry["name"] for entry in shards]
        self._numbers = {name: number for number, name in enumerate(self._names)}
        self.samples = [(f"{self.root}/{entry['name']}#{i}", label if self.labeled else UNLABELED)
                        for entry in shards for i, label in enumerate(entry["labels"])]
        self._open: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = {}  # litdata datasets hold memory maps: reopened in each worker
        state.pop("loader")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.loader = self._read

    def _shard(self, number: int) -> Any:
        """The litdata dataset of shard ``number``, opened once per process: its ``index.json``
        checked first (serializers, chunk names); at a URL, its chunks fetched into the cache
        and checked against the manifest's SHA-256 before litdata reads them."""
        if number not in self._open:
            from litdata import StreamingDataset

            # One item per read (litdata >= 0.2.7x decodes windows of rows by default: ~1 ms
            # per random read instead of ~40 us, benchmarks/streaming_throughput.py).
            per_item = ({"batch_decode": 0} if "batch_decode" in
                        inspect.signature(StreamingDataset.__init__).parameters else {})
            name = self._names[number]
            entry = self.manifest["shards"][number]
            folder = self.remote.cache / name if self.remote is not None else \
                Path(self.root) / name
            problem = index_file_problem(folder / LITDATA_INDEX)
            if problem is not None:
                raise ShardError(f"shard {self.root}/{name}: {problem}")
            if self.remote is not None:
                for file, expected in entry["files"].items():
                    self.remote.fetch(f"{name}/{file}", expected)
            where = self.remote.dataset_dir(name) if self.remote is not None else str(folder)
            self._open[number] = StreamingDataset(where, **per_item)
        return self._open[number]

    def _read(self, name: str) -> Image.Image:
        """Decode the sample named ``<root>/<shard>#<position>``."""
        shard, position = name.rsplit("/", 1)[1].split("#")
        number = self._numbers[shard]
        dataset = self._shard(number)
        try:
            data, _, source = dataset[int(position)]
        except Exception as err:
            raise ShardError(self._damaged(number, err)) from err
        try:
            return load_image(io.BytesIO(bytes(data)))
        except CorruptImageError as err:
            cause = type(err.__cause__ or err).__name__
            raise CorruptImageError(
                f"Cannot decode image {name} (from {source}: {cause}); fix or remove the "
                "source image and rerun the shard command into a new folder.") from err

    def _damaged(self, number: int, err: Exception) -> str:
        """The message of a shard whose chunk litdata cannot read: the shard, its chunk and
        the fix (the local cache folder to delete, or the shard command to rerun)."""
        entry = self.manifest["shards"][number]
        chunks = ", ".join(f for f in entry["files"] if f != LITDATA_INDEX)
        if self.remote is not None:
            where = self.remote.cache / entry["name"]
            fix = (f"Delete the local cache folder {self.remote.cache} (it holds only "
                   "downloaded copies) and rerun.")
        else:
            where = Path(self.root) / entry["name"]
            fix = (f"Rerun `python -m ssl_lightning shard --images {self.manifest['images']} "
                   f"--output {self.root}`, which rewrites the shards that do not match the "
                   "manifest.")
        return (f"shard {self.root}/{entry['name']} cannot be read: its chunk {chunks} in "
                f"{where} is damaged ({type(err).__name__}: {err}). {fix}")

    def __repr__(self) -> str:
        kind = f"{len(self.classes)} classes" if self.labeled else "unlabeled"
        return (f"{type(self).__name__}({self.root}, {len(self)} images in "
                f"{len(self._names)} shards, {kind})")


class StreamingDataModule(SSLDataModule):
    """Pre-training on a shard folder, evaluation on a labeled one; everything else (views,
    batched device views, per-sample seeding, DDP split, exact mid-epoch resume, skip policy)
    is :class:`SSLDataModule`'s, as for :class:`~ssl_lightning.data.ImageFolderDataModule`.

    Evaluation splits as for an image folder: labeled train shards + ``val_shards``: bank =
    train, queries = val; unlabeled train + ``val_shards``: the val images alternate between
    bank (even positions) and queries (odd); no ``val_shards``: no validation loaders.

    Args:
        train_shards: Shard folder of the training images (``python -m ssl_lightning shard``):
            a path, or a URL litdata reads (``s3://``, ``gs://``, ``azure://``, ``hf://``,
            ``r2://``, ``local:``; docs/streaming.md).
        val_shards: Shard folder (path or URL) of labeled evaluation images, or None.
        train_labeled: Use the train shards' labels; None: when the manifest has >= 2 classes.
        preset: ``"imagenet"`` (224 px) or ``"cifar"`` (32 px) default transforms.
        verify_checksums: At setup, also compare the SHA-256 of every shard file with the
            manifest (reads every byte once; sizes and litdata indexes are always checked).
        cache_dir: Where shards at a URL are cached, one folder per URL (``<cache_dir>/<hash
            of the URL>``); None: ``~/.cache/ssl_lightning/shards``. Unused for local folders.
        **kwargs: Loader and transform arguments of :class:`SSLDataModule`.
    """

    def __init__(self, train_shards: str, val_shards: str | None = None,
                 train_labeled: bool | None = None, preset: PresetName = "imagenet",
                 verify_checksums: bool = False, cache_dir: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(preset=preset, **kwargs)
        self.train_shards = train_shards
        self.val_shards = val_shards
        self.train_labeled = train_labeled
        self.verify_checksums = verify_checksums
        self.cache_dir = cache_dir

    def _dataset(self, root: str, labeled: bool, transform: Any) -> ShardDataset:
        return ShardDataset(root, labeled, transform, self.unreadable, self.verify_checksums,
                            self.cache_dir)

    def _manifest(self, root: str) -> dict[str, Any]:
        return read_manifest(RemoteShards(root, self.cache_dir) if is_url(root) else root)

    def _train_is_labeled(self) -> bool:
        classes = len(self._manifest(self.train_shards)["classes"])
        if self.train_labeled is True and classes < 2:
            raise ValueError(f"train_labeled: true, but the shards {self.train_shards} have "
                             f"{classes} class(es). Set train_labeled: null or false.")
        return self.train_labeled is not False and classes >= 2

    @property
    def num_classes(self) -> int | None:  # type: ignore[override]
        """Classes of ``val_shards`` (or of labeled train shards); None if unlabeled."""
        if self.val_shards is not None:
            return len(self._manifest(self.val_shards)["classes"]) or None
        return len(self._manifest(self.train_shards)["classes"]) if self._train_is_labeled() \
            else None

    def build_train(self, transform: MultiViewTransform) -> Dataset:
        return self._dataset(self.train_shards, self._train_is_labeled(), transform)

    def build_eval(self, transform: EvalTransform) -> tuple[Dataset, Dataset] | None:
        if self.val_shards is None:
            return None
        val = self._dataset(self.val_shards, True, transform)
        train = self._dataset(self.train_shards, True, transform) if self._train_is_labeled() \
            else None
        return eval_splits(val, train)
