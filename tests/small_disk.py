"""A small file system mounted for a test: a disk that fills up (a tmpfs; needs root,
the one allowed reason to skip: tests/skip_policy.py)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``64k``, ``2m``) mounted at ``mount`` (made if missing) while the block runs."""
    mount.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(disk: Path, leave_bytes: int) -> Path:
    """Write a file on ``disk`` until about ``leave_bytes`` are free; the file."""
    import os

    filler = disk / "filler"
    stats = os.statvfs(disk)
    free = stats.f_bavail * stats.f_frsize
    filler.write_bytes(b"\0" * max(0, free - leave_bytes))
    return filler
