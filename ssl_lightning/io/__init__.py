"""Files that are complete or absent, and run directories that one run holds at a time.

- :func:`atomic_path` / :func:`atomic_open`: write to a temporary name in the destination
  directory, fsync, rename (used by ``embed``, ``export`` and the checkpoints);
  :func:`atomic_torch_save` saves a torch object that way.
- :class:`AtomicCheckpointIO`: Lightning's checkpoint plug-in on top of them.
- :func:`run_directory`: a run's own folder, whatever the logger; :func:`latest_checkpoint`:
  the newest checkpoint of a logger's runs (``--ckpt_path last``).
- :class:`RunDirectoryLock`: refuses a ``fit`` whose run directory another live run holds.
- :mod:`ssl_lightning.io.distributed_checkpoint`: sharded checkpoint directories read as data
  (``SafeReader``: allow-listed ``.metadata``, ``weights_only`` byte items, shard names checked).
"""

from ssl_lightning.io.atomic import atomic_open, atomic_path, atomic_torch_save, same_file
from ssl_lightning.io.checkpoint_io import AtomicCheckpointIO, with_atomic_checkpoint_io
from ssl_lightning.io.run_directory import latest_checkpoint, run_directory
from ssl_lightning.io.run_lock import RunDirectoryInUseError, RunDirectoryLock, lock_run_directory

__all__ = [
    "AtomicCheckpointIO",
    "RunDirectoryInUseError",
    "RunDirectoryLock",
    "atomic_open",
    "atomic_path",
    "atomic_torch_save",
    "latest_checkpoint",
    "lock_run_directory",
    "run_directory",
    "same_file",
    "with_atomic_checkpoint_io",
]
