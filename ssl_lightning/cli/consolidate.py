"""``python -m ssl_lightning consolidate SHARDED_DIR OUTPUT [--overwrite]``: one checkpoint file
from a sharded (``ShardedStrategy``) checkpoint directory, read as data
(:func:`ssl_lightning.distributed.sharding.load_sharded_checkpoint`)."""

from __future__ import annotations

import os
from pathlib import Path

from ssl_lightning.distributed.sharding import load_sharded_checkpoint


def consolidate(source: str | os.PathLike[str], output: str | os.PathLike[str],
                overwrite: bool = False) -> None:
    """Write the sharded checkpoint directory ``source`` as one checkpoint file ``output``
    (:func:`load_sharded_checkpoint`; temporary file + rename), which ``export``, ``embed``,
    ``LinearEval`` and ``KNNEval`` read like a DDP run's.

    Raises:
        ValueError: ``output`` is inside ``source`` (it would replace a file of the checkpoint),
            is a directory, or is an existing file and ``overwrite`` is False; ``source`` is
            not a readable sharded checkpoint.
    """
    from ssl_lightning.io.atomic import atomic_torch_save

    target = Path(output)
    if target.resolve().is_relative_to(Path(source).resolve()):
        raise ValueError(f"the output {os.fspath(output)} is inside the checkpoint directory "
                         f"{os.fspath(source)} and would replace or add a file of it; write "
                         "the consolidated file elsewhere, e.g. consolidated.ckpt beside it.")
    if target.is_dir():
        raise ValueError(f"the output {os.fspath(output)} is a directory; name a "
                         "file, e.g. consolidated.ckpt.")
    if (target.exists() or target.is_symlink()) and not overwrite:
        raise ValueError(f"the output {os.fspath(output)} exists; name a new file, or pass "
                         "--overwrite to replace it.")
    atomic_torch_save(load_sharded_checkpoint(source), os.fspath(output))


def main(args: list[str] | None = None) -> None:
    """``python -m ssl_lightning consolidate SHARDED_DIR OUTPUT [--overwrite]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m ssl_lightning consolidate",
        description="One checkpoint file (full weights, hyperparameters, backbone spec; no "
                    "optimiser state) from a sharded (ShardedStrategy) checkpoint directory.")
    parser.add_argument("source", help="the sharded checkpoint directory, e.g. last.ckpt")
    parser.add_argument("output", help="the checkpoint file to write (not inside source)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUTPUT if it exists (refused by default)")
    parsed = parser.parse_args(args)
    try:
        consolidate(parsed.source, parsed.output, overwrite=parsed.overwrite)
    except (ValueError, OSError) as error:
        parser.exit(2, f"error: {error}\n")
    print(f"Wrote {parsed.output} from the shards of {parsed.source}.")
