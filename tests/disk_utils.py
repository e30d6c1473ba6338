"""``small_tmpfs``: a 1 MiB tmpfs mounted for one test (the test is skipped where it cannot be
mounted), to fill a disk for real."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

SMALL_DISK_BYTES = 1 << 20


@contextmanager
def small_tmpfs(mount_point: Path) -> Iterator[Path]:
    """Mount a fresh 1 MiB tmpfs on ``mount_point`` (created) for the block, then unmount it."""
    mount_point.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK_BYTES}", "tmpfs", str(mount_point)],
        capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill ({mounted.stderr.strip() or 'mount'} "
                    "failed: needs root or CAP_SYS_ADMIN)")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)
