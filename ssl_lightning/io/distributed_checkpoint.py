"""Distributed (sharded) checkpoint directories read as data, never as code.

torch's :class:`~torch.distributed.checkpoint.FileSystemReader` reads a directory's ``.metadata``
with a plain ``pickle.load`` and its default planner reads every non-tensor ("byte") item with
``torch.load(weights_only=False)``: a crafted directory could run any command it names.
:class:`SafeReader` is the reader every sharded load of this package goes through
(:func:`read_metadata`, :func:`load_state`):

- ``.metadata`` is unpickled with :class:`_MetadataUnpickler`, which admits only the classes a
  checkpoint's metadata is made of (:data:`METADATA_CLASSES`, the torch dtypes); any other
  name is refused before it is looked up;
- byte items are read with ``torch.load(weights_only=True)`` (tensors and plain data);
- every shard file the metadata names must be a plain name inside the directory, exist and be
  long enough for the items it holds, so a missing or truncated shard is named before
  anything is read.

Every refusal is a :class:`ShardedCheckpointError` (a ``ValueError``) naming the directory, the
file and the cause.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

#: The file of a distributed checkpoint that describes its tensors and shards.
METADATA_FILE = ".metadata"
#: ``(module, name)`` of every class a checkpoint's ``.metadata`` may name, as written by
#: ``ShardedStrategy`` (torch 2.x; the torch dtypes are admitted besides, by type).
METADATA_CLASSES = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a name ("torch.strided") to the layout
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath",
                                     "PureWindowsPath")),  # the checkpoint_id it was saved to
})
_FIX = ("Use another checkpoint (an earlier one beside it), or write this one again; a sharded "
        "checkpoint holds .metadata, meta.pt and one __<rank>_0.distcp shard per process.")


class ShardedCheckpointError(ValueError):
    """A sharded checkpoint directory that is refused or cannot be read; the message names the
    directory, the file and the cause."""


class _Refused(pickle.UnpicklingError):
    """A pickle that names or changes something a checkpoint's metadata does not."""


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles only the classes of :data:`METADATA_CLASSES` and the torch dtypes, and sets
    state only on instances (a ``BUILD`` on an admitted class or function would change it for
    the whole process). The pure-Python unpickler, whose opcodes can be overridden."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_CLASSES or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Refused(f"it names {module}.{name}, which is not part of a checkpoint's metadata")

    def _load_build(self) -> None:
        target = self.stack[-2]  # type: ignore[attr-defined]
        if isinstance(target, type) or callable(target):
            name = getattr(target, "__qualname__", type(target).__name__)
            raise _Refused(f"it sets attributes of {getattr(target, '__module__', '?')}.{name}, "
                           "which a checkpoint's metadata never does")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = _load_build  # type: ignore[assignment]


def _refusal(directory: str, file: str, cause: str) -> ShardedCheckpointError:
    return ShardedCheckpointError(
        f"Sharded checkpoint {directory!r}: {file} {cause}. {_FIX}")


class _WeightsOnlyBytes:
    """A :class:`DefaultLoadPlanner` whose byte items are read with
    ``torch.load(weights_only=True)`` (the planner's own reading allows any pickle)."""

    def __init__(self, planner: LoadPlanner, directory: str) -> None:
        if not isinstance(planner, DefaultLoadPlanner):
            raise TypeError(f"SafeReader reads byte items for a DefaultLoadPlanner, not a "
                            f"{type(planner).__name__}")
        self._planner = planner
        self._directory = directory

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise _refusal(self._directory, f"the item {fqn!r}",
                           "is refused: it pickles Python objects besides tensors and plain "
                           "data, and loading it could run code") from err
        planner = self._planner
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[fqn], loaded)
        else:
            planner.state_dict[fqn] = loaded


class SafeReader(FileSystemReader):
    """:class:`FileSystemReader` that reads a local directory as data (see the module doc)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.directory = os.fspath(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The directory's ``.metadata``, unpickled with the allow-list and checked against the
        shard files (a per-rank ``__<rank>.metadata`` is not read: this package writes none).

        Raises:
            ShardedCheckpointError: Missing, truncated or refused ``.metadata``; a shard file
                named outside the directory, missing or shorter than its items.
        """
        if kwargs.get("rank") is not None:
            raise _refusal(self.directory, f"__{kwargs['rank']}{METADATA_FILE}",
                           "is not read (per-process metadata is not written by this package)")
        path = Path(self.directory) / METADATA_FILE
        try:
            with open(path, "rb") as file:
                metadata = _MetadataUnpickler(file).load()
        except FileNotFoundError as err:
            raise _refusal(self.directory, METADATA_FILE, "is missing") from err
        except _Refused as err:
            raise _refusal(self.directory, METADATA_FILE,
                           f"is refused: {err}, and loading it could run code") from err
        except pickle.UnpicklingError as err:
            raise _refusal(self.directory, METADATA_FILE,
                           f"is damaged ({err}); the file is probably truncated") from err
        except Exception as err:  # truncated or foreign bytes fail in many ways
            raise _refusal(self.directory, METADATA_FILE,
                           f"cannot be read ({type(err).__name__}: {err}); the file is "
                           "probably truncated or not a checkpoint's metadata") from err
        if not isinstance(metadata, Metadata):
            raise _refusal(self.directory, METADATA_FILE,
                           f"holds a {type(metadata).__name__}, not a checkpoint's metadata")
        self._check_shards(metadata)
        return _with_load_id(metadata, self.load_id)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self._check_shards(metadata)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return super().read_data(plan, _WeightsOnlyBytes(planner, self.directory))  # type: ignore[arg-type]

    def _check_shards(self, metadata: Metadata) -> None:
        """Every shard file named by ``metadata``: a plain name, present, long enough."""
        needed: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            name = str(getattr(info, "relative_path", ""))
            if name in ("", ".", "..") or PurePosixPath(name).name != name or "\\" in name:
                raise _refusal(self.directory, METADATA_FILE,
                               f"names the shard file {name!r}, which is not a file name "
                               "inside the directory")
            end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
            needed[name] = max(needed.get(name, 0), end)
        for name, end in sorted(needed.items()):
            path = Path(self.directory) / name
            if not path.is_file():
                raise _refusal(self.directory, name, "is missing (a process's shard)")
            size = path.stat().st_size
            if size < end:
                raise _refusal(self.directory, name,
                               f"is truncated: {size} bytes, its items need {end}")


def _with_load_id(metadata: Metadata, load_id: str) -> Metadata:
    """``metadata`` with the storage fields :class:`FileSystemReader` sets on reading."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = load_id
    return metadata


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """The checked ``.metadata`` of the sharded checkpoint directory ``path`` (see
    :meth:`SafeReader.read_metadata`)."""
    return SafeReader(path).read_metadata()


def load_state(state: dict[str, Any], path: str | os.PathLike[str],
               planner: LoadPlanner | None = None, no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint``'s load of ``path`` into ``state`` through
    :class:`SafeReader`; the metadata is read and checked first, and a failure while the shards
    are read is one :class:`ShardedCheckpointError` naming the directory.

    Args:
        state: The state dict to fill (in place), as for ``torch.distributed.checkpoint.load``.
        path: The checkpoint directory.
        planner: The load planner (a ``DefaultLoadPlanner``; default: one).
        no_dist: Load on this process alone, without a process group.
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = SafeReader(path)
    reader.read_metadata()
    try:
        _load_state_dict(state, storage_reader=reader, planner=planner or DefaultLoadPlanner(),
                         no_dist=no_dist)
    except CheckpointException as err:
        causes = [failure[0] for failure in err.failures.values()]
        ours = [c for c in causes if isinstance(c, ShardedCheckpointError)]
        if ours:
            raise ours[0] from err
        first = causes[0] if causes else err
        raise _refusal(reader.directory, "a shard",
                       f"cannot be read ({type(first).__name__}: {first}); a shard file is "
                       "probably damaged") from err
