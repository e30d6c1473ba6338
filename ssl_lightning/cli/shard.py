"""``python -m ssl_lightning shard --images DIR --output DIR``: a folder of images written as
litdata shards for :class:`~ssl_lightning.data.StreamingDataModule`
(:func:`ssl_lightning.data.shards.write_shards`); a mistake or a failed write is one ``error:``
line (exit 2)."""

from __future__ import annotations

import argparse
from typing import Any

from ssl_lightning.cli.errors import one_line
from ssl_lightning.data.shards import write_shards


def main(args: list[str] | None = None) -> dict[str, Any]:
    """The ``shard`` command; a mistake or a failed write is one ``error:`` line (exit 2)."""
    parser = argparse.ArgumentParser(
        prog="python -m ssl_lightning shard",
        description="Write a folder of images (ImageFolder labels when it holds class folders) "
                    "as litdata shards with a manifest, for StreamingDataModule. Rerun the "
                    "same command to resume an interrupted run or repair damaged shards.")
    parser.add_argument("--images", required=True, help="folder of images")
    parser.add_argument("--output", required=True, help="new, empty or earlier shard folder")
    parser.add_argument("--shard-size", type=int, default=1000, help="images per shard")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    options = parser.parse_args(args)
    try:
        manifest = write_shards(options.images, options.output, options.shard_size,
                                progress=not options.no_progress)
    except (ValueError, OSError) as err:
        parser.exit(2, f"error: {one_line(err)}\n")
    print(f"{manifest['num_images']} images, {len(manifest['classes'])} classes, "
          f"{len(manifest['shards'])} shards, {manifest['bytes']} bytes in {options.output}")
    return manifest
