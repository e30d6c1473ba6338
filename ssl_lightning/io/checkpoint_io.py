"""Lightning checkpoints written atomically in their own directory.

Lightning's :class:`~lightning_fabric.plugins.TorchCheckpointIO` stages a local checkpoint in
``$TMPDIR`` and moves it into place; when ``$TMPDIR`` is on another filesystem the move is a
copy over the previous file, so an interrupt or a full disk leaves a truncated ``last.ckpt``.
:class:`AtomicCheckpointIO` writes beside the target instead (see :mod:`ssl_lightning.io.atomic`):
the previous checkpoint stays complete until the new one is.

Every ``python -m ssl_lightning fit`` run uses it; from Python::

    Trainer(plugins=[AtomicCheckpointIO()], callbacks=[RunDirectoryLock(), ...])
"""

from __future__ import annotations

import os
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from ssl_lightning._lightning import _PATH, CheckpointIO, TorchCheckpointIO, get_filesystem
from ssl_lightning.io.atomic import atomic_torch_save


class AtomicCheckpointIO(TorchCheckpointIO):
    """:class:`TorchCheckpointIO` whose local saves go to a temporary file in the target's
    directory, flushed, fsync-ed and renamed; on an error the temporary file is removed and the
    previous checkpoint kept. Remote paths (``s3://`` ...) are left to Lightning."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH,
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` to ``path`` atomically (see the class docstring).

        Raises:
            OSError: The write failed (e.g. no space left); names ``path``, which is unchanged.
        """
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        atomic_torch_save(checkpoint, os.fspath(path))


def with_atomic_checkpoint_io(plugins: Any) -> list[Any]:
    """``plugins`` (a Trainer's ``plugins`` value: None, one plug-in or a list) plus an
    :class:`AtomicCheckpointIO`, unless they already hold a :class:`CheckpointIO`."""
    plugins = [] if plugins is None else list(plugins) if isinstance(plugins, list | tuple) \
        else [plugins]
    if any(isinstance(p, CheckpointIO) for p in plugins):
        return plugins
    return [*plugins, AtomicCheckpointIO()]
