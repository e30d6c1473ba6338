"""Listing a large image folder: our index (first walk and cached) vs torchvision's ImageFolder.

Makes ``--files`` empty ``.jpg`` files in ``--folders`` class folders under a temporary directory
(listing never opens a file, so empty files time the same as images), then times, side by side
in one run, each ``--repeats`` times (the median is printed):

- ``ImageFolderDataset(root)`` with the cache off: the scandir walk (``data/indexing.py``);
- the same with the cache, first call (walk + write) and second call (read + check the folders);
- ``torchvision.datasets.ImageFolder(root)``'s indexing (``make_dataset``), for reference.

It also checks the index: every file listed exactly once, in sorted order, the same list from the
cache as from the walk.

    python benchmarks/index_speed.py --files 1000000 --folders 1000
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from torchvision.datasets.folder import make_dataset

from ssl_lightning.data.datasets import ImageFolderDataset
from ssl_lightning.data.indexing import SETTLE_S


def make_tree(root: Path, files: int, folders: int) -> list[str]:
    """``files`` empty images spread over ``folders`` class folders; their sorted paths."""
    paths = []
    per_folder = -(-files // folders)
    for f in range(folders):
        folder = root / f"class_{f:05d}"
        folder.mkdir()
        for i in range(min(per_folder, files - f * per_folder)):
            path = folder / f"{i:07d}.jpg"
            path.touch()
            paths.append(str(path))
    return sorted(paths)


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def measure(files: int, folders: int, repeats: int = 3) -> dict[str, float]:
    """Median seconds of each listing of a fresh tree of ``files`` empty images (see the module
    docstring), after checking that all list the same files in the same order; the tree's
    making time as ``make_s``."""
    with tempfile.TemporaryDirectory() as tmp:
        root, cache = Path(tmp) / "images", Path(tmp) / "cache"
        root.mkdir()
        start = time.perf_counter()
        expected = make_tree(root, files, folders)
        make_s = time.perf_counter() - start
        time.sleep(SETTLE_S + 0.5)  # the folders' times settle, so that the cache is written
        saved = {k: os.environ.get(k) for k in ("SSL_LIGHTNING_INDEX_CACHE",
                                                  "SSL_LIGHTNING_CACHE_DIR")}
        try:
            os.environ["SSL_LIGHTNING_INDEX_CACHE"] = "0"
            walk_s, walked = timed(lambda: ImageFolderDataset(root), repeats)
            os.environ["SSL_LIGHTNING_INDEX_CACHE"] = "1"
            os.environ["SSL_LIGHTNING_CACHE_DIR"] = str(cache)
            first_s, _ = timed(lambda: ImageFolderDataset(root), 1)
            assert len(list((cache / "image_index").iterdir())) == 1, "the cache was not written"
            cached_s, cached = timed(lambda: ImageFolderDataset(root), repeats)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        classes = sorted(p.name for p in root.iterdir())
        index = {name: i for i, name in enumerate(classes)}
        torchvision_s, reference = timed(
            lambda: make_dataset(str(root), index, extensions=(".jpg",)), repeats)

        listed = [path for path, _ in walked.samples]  # type: ignore[attr-defined]
        assert listed == expected, "the walk lists another set or order of files"
        assert [p for p, _ in cached.samples] == listed, "the cache differs from the walk"  # type: ignore[attr-defined]
        assert len(set(listed)) == len(listed) == files
        assert [p for p, _ in reference] == listed  # type: ignore[union-attr]
    return {"make_s": make_s, "walk_s": walk_s, "first_s": first_s, "cached_s": cached_s,
            "torchvision_s": torchvision_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--folders", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    r = measure(args.files, args.folders, args.repeats)
    print(f"made {args.files:,} files in {args.folders:,} folders in {r['make_s']:.1f} s")
    print(f"ImageFolderDataset, walk (no cache): {r['walk_s']:6.2f} s")
    print(f"ImageFolderDataset, first (walk + write cache): {r['first_s']:6.2f} s")
    print(f"ImageFolderDataset, cached: {r['cached_s']:6.2f} s")
    print(f"torchvision ImageFolder indexing: {r['torchvision_s']:6.2f} s "
          f"({r['torchvision_s'] / r['walk_s']:.1f}x the walk, "
          f"{r['torchvision_s'] / r['cached_s']:.1f}x cached)")


if __name__ == "__main__":
    main()
