"""Appending bytes to a file whole or not at all.

The record sink and the batch runner append lines that a later reader parses: a
write a full disk refuses part-way must not leave a cut line for the next one to
land after (a line that is not JSON, or the same batch written twice). So the
append goes through the file descriptor, unbuffered (no library buffer to flush
again on close), and what reached the file is truncated away when it fails.
"""

from __future__ import annotations

import os
from pathlib import Path


def append_whole(path: Path, data: bytes, sync: bool = False) -> None:
    """Append ``data`` to ``path`` (made if missing); ``sync``: flushed to disk before
    it returns. On an OSError the file is as it was, and the error is raised."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]  # a full disk may take part of it, then refuse
            if sync:
                os.fsync(fd)
        except OSError:
            os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)
