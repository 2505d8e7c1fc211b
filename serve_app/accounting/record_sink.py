"""Final request records on disk: append-only JSONL files, one folder per UTC hour.

``<sink_dir>/<YYYYMMDD>/<HH>/<writer>.jsonl``: each ingress replica (``writer``)
appends to its own file, so no two processes write one file (a shared mount's
appends are not atomic across hosts). A record is filed by the hour it was
received (``received_ms``; ``finished_ms`` for one admitted without Redis), the
hour its request id names (``usage.new_request_id``), so a lookup by id reads one
hour's files (and its neighbours, for clocks that differ). A record may be written
twice (its shipper died between writing and acknowledging it): lookups take the
first. Whole days older than the retention are removed by ``sweep``.
"""

from __future__ import annotations

import datetime
import functools
import json
import mmap
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from serve_app.accounting.usage import id_time
from serve_app.appends import append_whole

_DAY = re.compile(r"^\d{8}$")
_HOUR_MS = 3600 * 1000


def _hour_dir(root: Path, ms: int) -> Path:
    return _hour_path(root, ms // _HOUR_MS)


@functools.lru_cache(maxsize=256)
def _hour_path(root: Path, hour: int) -> Path:
    """An hour's folder, made once: a batch's records are nearly all of one hour, and
    a datetime, two strftime and two pathlib joins per record showed in py-spy's profile
    of the shipping replica (bench/gateway_capacity.py)."""
    when = datetime.datetime.fromtimestamp(hour * _HOUR_MS / 1000, datetime.UTC)
    return root / when.strftime("%Y%m%d") / when.strftime("%H")


class RecordSink:
    def __init__(self, directory: str, retention_s: int):
        self.root = Path(directory).expanduser()
        self.retention_s = retention_s

    def append(self, writer: str, records: list[dict[str, Any]]) -> int:
        """Append ``records`` to ``writer``'s files, flushed to disk before it
        returns (the caller then forgets them). Returns the bytes written. A write the
        disk refuses (full) is undone before it raises: a file never keeps a part of
        a batch that will be written again whole."""
        by_file: dict[Path, list[str]] = {}
        for record in records:
            when = int(record.get("received_ms") or record.get("finished_ms") or 0)
            path = _hour_dir(self.root, when) / f"{writer}.jsonl"
            by_file.setdefault(path, []).append(json.dumps(record, separators=(",", ":")) + "\n")
        written, done = 0, []
        try:
            for path, lines in by_file.items():
                path.parent.mkdir(parents=True, exist_ok=True)
                data = "".join(lines).encode()
                size = path.stat().st_size if path.exists() else 0
                append_whole(path, data, sync=True)  # a write the disk refused part-way leaves nothing
                done.append((path, size))
                written += len(data)
        except OSError:
            for path, size in done:  # the batch's other hours: taken back too, it is written again whole
                os.truncate(path, size)
            raise
        return written

    def find(
        self, request_id: str | None = None, *, http_request_id: str | None = None, key_id: str | None = None
    ) -> dict[str, Any] | None:
        """The record of ``request_id`` (a request id of ours: read from the hour
        it names), or of ``http_request_id`` (a client's x-request-id: every file
        of the retention is read, oldest first; among ``key_id``'s requests the
        last that used it, else the first of any key, as Redis' index answers)."""
        if request_id is not None:
            when = id_time(request_id)
            files = self._files_near(when) if when is not None else self._files(newest_first=True)
            needle = f'"id":{json.dumps(request_id)}'.encode()
            for record in self._matching(files, needle):
                if record.get("id") == request_id:
                    return record
            return None
        needle = f'"http_request_id":{json.dumps(http_request_id)}'.encode()
        found = None
        for record in self._matching(self._files(newest_first=False), needle):
            if record.get("http_request_id") != http_request_id:
                continue
            if key_id is None:
                return record
            if record.get("key_id") == key_id:
                found = record
        return found

    def sweep(self, now_s: float) -> int:
        """Remove the days wholly past the retention; returns how many."""
        if not self.root.is_dir():
            return 0
        oldest = datetime.datetime.fromtimestamp(now_s - self.retention_s, datetime.UTC)
        removed = 0
        for day in self.root.iterdir():
            if _DAY.match(day.name) and day.name < oldest.strftime("%Y%m%d"):
                shutil.rmtree(day, ignore_errors=True)
                removed += 1
        return removed

    def _files_near(self, ms: int) -> list[Path]:
        hours = [_hour_dir(self.root, ms + delta) for delta in (0, -_HOUR_MS, _HOUR_MS)]
        return [path for hour in hours if hour.is_dir() for path in sorted(hour.glob("*.jsonl"))]

    def _files(self, newest_first: bool) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(self.root.glob("*/*/*.jsonl"), reverse=newest_first)

    @staticmethod
    def _matching(files: list[Path], needle: bytes) -> Iterator[dict[str, Any]]:
        """Records of ``files`` whose line contains ``needle`` (a byte search first:
        only candidate lines are parsed)."""
        for path in files:
            try:
                with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                    yield from _lines_with(data, needle)
            except (OSError, ValueError):  # removed by a sweep meanwhile; empty (mmap refuses 0 bytes)
                continue


def _lines_with(data, needle: bytes) -> Iterator[dict[str, Any]]:
    start = data.find(needle)
    while start >= 0:
        line_start = data.rfind(b"\n", 0, start) + 1
        line_end = data.find(b"\n", start)
        if line_end < 0:  # a line being written
            return
        try:
            record = json.loads(data[line_start:line_end])
        except ValueError:
            record = None
        if record is not None:
            yield record
        start = data.find(needle, line_end)
