"""OpenAI's Files API, for batches: the content in a directory, the metadata in Redis.

A file belongs to the key that uploaded it (or whose batch wrote it): its
metadata is named per key (``redis_names``), so another key's file id is simply
not found, and its content lies under ``<files_dir>/<key id>/<file id>``. Files
expire after ``RETENTION_S`` (OpenAI's default for batch files); the metadata
expires by its TTL and ``sweep`` removes content whose metadata is gone, so the
directory does not grow without bound. Uploads are written to a temporary name
and renamed when complete: a failed upload (full disk, client gone) leaves
nothing behind and no file id.

A key's files are bounded (``batch.max_bytes_per_key``, ``max_files_per_key``):
an upload reserves its declared size in Redis before a byte is written, and is
refused (400 ``file_storage_limit_exceeded``) if the key would pass either
bound, so concurrent uploads cannot fill the disk that every key shares. Its
real size replaces the reservation once written; a delete, a failed upload or
the file's expiry gives the room back. A batch's results count but are never
refused: they are work the key already paid for.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import time
import uuid
from collections.abc import Generator
from pathlib import Path
from typing import Any, BinaryIO

from serve_app.accounting.storage_account import StorageAccount
from serve_app.errors import OpenAIError, shown
from serve_app.redis_store import redis_names
from serve_app.stored.listings import index_page
from serve_app.wire.api_requests import parse_json_object

RETENTION_S = 30 * 24 * 3600
_RESULT_WINDOW_S = 48 * 3600  # a batch's results are written within its window; then they are its file
PURPOSES = ("batch",)  # what can be uploaded; batch outputs are "batch_output"
BATCH_METHODS = ("POST",)
_PARTIAL_SUFFIX = ".partial"
_SWEEP_MIN_AGE_S = 3600  # content younger than this may belong to an upload or batch being written
# How long an upload's reservation holds if its ingress dies mid-upload.
_RESERVATION_S = 6 * 3600


class FileTooLarge(Exception):
    pass


def storage_full() -> OpenAIError:
    return OpenAIError(
        507,
        "The file store is full. Please retry later or delete files you no longer need.",
        type="server_error",
        code="storage_full",
    )


def not_found(file_id: str) -> OpenAIError:
    return OpenAIError(404, f"No such File object: {file_id}", param="file_id", code="file_not_found")


def file_space(redis, max_bytes: int, max_files: int) -> StorageAccount:
    """Each key's files on disk (uploads and batch results): reserved before an
    upload is written, recorded as written, released when deleted or expired."""
    return StorageAccount(
        redis,
        lambda key_id: [redis_names.file_space(key_id), redis_names.file_space_expiry(key_id)],
        max_bytes,
        max_files,
        RETENTION_S,
        what="files",
        param="file",
        code="file_storage_limit_exceeded",
        remedy="Delete files you no longer need (DELETE /v1/files/{file_id}) to make room.",
    )


class FileStore:
    def __init__(
        self, redis, directory: str, max_bytes: int, max_key_bytes: int = 1 << 62, max_key_files: int = 1 << 62
    ):
        self.redis = redis
        self.dir = Path(directory).expanduser()
        self.max_bytes = max_bytes
        self.space = file_space(redis, max_key_bytes, max_key_files)

    def path(self, key_id: str, file_id: str) -> Path:
        if not FILE_ID.fullmatch(file_id):  # never a path a client chose
            raise not_found(file_id)
        return self.dir / key_id / file_id

    def partial_path(self, key_id: str, name: str) -> Path:
        """Where a batch writes results before they become a file."""
        return self.dir / key_id / (name + _PARTIAL_SUFFIX)

    # -- writing -----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def reservation(self, key_id: str, declared_bytes: int):
        """A new file id with room reserved for it: ``declared_bytes`` (the upload
        request's length, which the file cannot pass), at most ``max_bytes``. Taken
        before the request's body is read; given back if the block fails."""
        file_id = new_file_id()
        await self.space.reserve(key_id, file_id, min(declared_bytes, self.max_bytes), time.time() + _RESERVATION_S)
        try:
            yield file_id
        except BaseException:
            await asyncio.shield(self.space.release(key_id, file_id))  # a client gone gives its room back too
            raise

    async def upload(self, key_id: str, file_id: str, filename: str, purpose: str, source: BinaryIO) -> dict[str, Any]:
        """Copy ``source`` in as the file ``file_id`` (reserved: ``reservation``), at
        most ``max_bytes`` (413 past it)."""
        target = self.path(key_id, file_id)
        try:
            size = await asyncio.to_thread(_copy_bounded, source, target, self.max_bytes)
        except FileTooLarge:
            raise OpenAIError(
                413, f"The file is larger than {self.max_bytes} bytes.", param="file", code="file_too_large"
            ) from None
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise storage_full() from None
            raise
        try:
            return await self._register(key_id, file_id, filename, purpose, size)
        except BaseException:
            target.unlink(missing_ok=True)
            raise

    async def grow_result(self, key_id: str, file_id: str, size: int) -> bool:
        """Room for ``size`` bytes more of the result file ``file_id`` (a batch's output
        or errors, counted against its key's files as each line is written), if the
        key's bound holds them; False if not (nothing counted)."""
        return await self.space.grow(key_id, file_id, size, time.time() + RETENTION_S + _RESULT_WINDOW_S)

    async def release_result(self, key_id: str, file_id: str) -> None:
        """A batch result file that will not be made: the room its lines took is given back."""
        await self.space.release(key_id, file_id)

    async def adopt(self, key_id: str, written: Path, filename: str, purpose: str, file_id: str) -> dict[str, Any]:
        """Make ``file_id`` of content already written in this store (a batch's
        results). Idempotent: a second call (a finalization resumed after a crash)
        finds the content moved and registers it if it is not yet."""
        target = self.path(key_id, file_id)
        if written.exists():
            os.replace(written, target)
        raw = await self.redis.get(redis_names.file_record(key_id, file_id))
        if raw is not None:
            return json.loads(raw)
        return await self._register(key_id, file_id, filename, purpose, target.stat().st_size)

    async def _register(self, key_id: str, file_id: str, filename: str, purpose: str, size: int) -> dict[str, Any]:
        now = int(time.time())
        record = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": now,
            "expires_at": now + RETENTION_S,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }
        await self.space.record(key_id, file_id, size, now + RETENTION_S)  # before the file exists for the client
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(redis_names.file_record(key_id, file_id), json.dumps(record), ex=RETENTION_S)
            pipe.zadd(redis_names.file_index(key_id), {file_id: time.time()})
            pipe.zremrangebyscore(redis_names.file_index(key_id), 0, time.time() - RETENTION_S)
            pipe.expire(redis_names.file_index(key_id), RETENTION_S)  # outlives every file it lists, no longer
            await pipe.execute()
        return record

    # -- reading -----------------------------------------------------------------

    async def get(self, key_id: str, file_id: str) -> dict[str, Any]:
        self.path(key_id, file_id)  # a well-formed id, or 404
        raw = await self.redis.get(redis_names.file_record(key_id, file_id))
        if raw is None or not self.path(key_id, file_id).exists():
            raise not_found(file_id)
        return json.loads(raw)

    async def page(self, key_id: str, purpose: str | None, limit: int, order: str, after: str | None) -> dict:
        """One page of OpenAI's ListFilesResponse (newest first by default)."""

        async def load(file_ids: list[str]) -> list[dict | None]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for file_id in file_ids:
                    pipe.get(redis_names.file_record(key_id, file_id))
                return [json.loads(raw) if raw else None for raw in await pipe.execute()]

        data, has_more = await index_page(
            self.redis,
            redis_names.file_index(key_id),
            load,
            limit,
            desc=order == "desc",
            after=after,
            keep=lambda record: purpose is None or record["purpose"] == purpose,
        )
        return {
            "object": "list",
            "data": data,
            "has_more": has_more,
            "first_id": data[0]["id"] if data else "",
            "last_id": data[-1]["id"] if data else "",
        }

    async def delete(self, key_id: str, file_id: str) -> dict[str, Any]:
        path = self.path(key_id, file_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(redis_names.file_record(key_id, file_id))
            pipe.zrem(redis_names.file_index(key_id), file_id)
            deleted, _ = await pipe.execute()
        if deleted:  # only a file this key has: another key's id never reaches the disk
            path.unlink(missing_ok=True)
            await self.space.release(key_id, file_id)
        if not deleted:
            raise not_found(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def sweep(self) -> int:
        """Remove content whose metadata expired (and uploads that never finished)."""
        removed = 0
        cutoff = time.time() - _SWEEP_MIN_AGE_S
        if not self.dir.exists():
            return 0
        for key_dir in self.dir.iterdir():
            for path in key_dir.iterdir() if key_dir.is_dir() else ():
                try:
                    if path.stat().st_mtime > cutoff:
                        continue
                except FileNotFoundError:
                    continue
                if FILE_ID.fullmatch(path.name):
                    if await self.redis.exists(redis_names.file_record(key_dir.name, path.name)):
                        continue
                elif path.name.endswith(_PARTIAL_SUFFIX):
                    continue  # a batch's results: removed when the batch ends
                path.unlink(missing_ok=True)
                removed += 1
        return removed


FILE_ID = re.compile(r"file-[0-9a-f]{32}")
_UNSAFE_IN_NAMES = re.compile(r'[\x00-\x1f\x7f"\\/]')


# How the HTML standard (and so httpx, the openai SDK's transport, and browsers)
# escapes a multipart filename: '"', CR and LF percent-encoded, UTF-8 as it is.
_FORM_ESCAPES = {"%22": '"', "%0D": "\r", "%0A": "\n"}


def safe_filename(name: str | None) -> str:
    """A client's file name as it is kept and sent back (Content-Disposition: RFC
    5987's ``filename*`` carries any Unicode): the form's escapes undone, then no
    control characters, quotes, backslashes or slashes, at most 256 characters."""
    name = re.sub("%22|%0D|%0A", lambda escape: _FORM_ESCAPES[escape.group(0).upper()], name or "", flags=re.IGNORECASE)
    return _UNSAFE_IN_NAMES.sub("_", name)[:256] or "upload.jsonl"


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex


def _copy_bounded(source: BinaryIO, target: Path, max_bytes: int) -> int:
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(target.name + ".uploading")
    size = 0
    try:
        with open(temporary, "wb") as out:
            while chunk := source.read(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise FileTooLarge
                out.write(chunk)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return size


def batch_lines(
    path: Path, max_requests: int, max_line_bytes: int, start: tuple[int, int] = (0, 0)
) -> Generator[dict[str, Any], None, None]:
    """The requests of a batch input file (OpenAI's JSONL: one object per line with
    ``custom_id``, ``method``, ``url`` and ``body``), one at a time, or a 400 naming
    the first line that is not one. Each line passes the checks a request body does
    (``parse_json_object``: depth, NaN and Infinity, lone surrogates) and is at
    most ``max_line_bytes`` (the request body limit: a line is a request).
    ``custom_id``s must be unique: results are matched by them. One line is held
    at a time (a file may be 200 MB): what a reader keeps is its own choice.
    ``start``: (byte offset, line number) to read from (a batch resumed past the
    lines it answered: checked whole when the batch was made); each request says
    where the line after it starts (``end``)."""
    seen: set[str] = set()
    offset, number = start
    with open(path, "rb") as lines:
        lines.seek(offset)
        # readline(n): a line longer than the bound is never read whole.
        while raw := lines.readline(max_line_bytes + 1):
            number += 1
            offset += len(raw)
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                raise _bad_line(number, f"is longer than {max_line_bytes} bytes, the request body limit")
            if not raw.strip():
                continue
            try:
                line = parse_json_object(raw)
            except OpenAIError as exc:
                raise _bad_line(number, f"is not a valid request ({exc.message})") from None
            del raw
            custom_id = line.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
                raise _bad_line(number, "needs 'custom_id', a string of 1 to 512 characters")
            if custom_id in seen:
                raise _bad_line(number, f"repeats custom_id {shown(custom_id)}; each request needs its own")
            if line.get("method") not in BATCH_METHODS:
                raise _bad_line(number, "needs 'method': 'POST'")
            if not isinstance(line.get("url"), str):
                raise _bad_line(number, "needs 'url', the endpoint (e.g. '/v1/chat/completions')")
            if not isinstance(line.get("body"), dict):
                raise _bad_line(number, "needs 'body', the request as a JSON object")
            if len(seen) == max_requests:
                raise OpenAIError(
                    400, f"The file has more than {max_requests} requests.", param="file", code="too_many_requests"
                )
            seen.add(custom_id)
            yield {"line": number, "custom_id": custom_id, "url": line["url"], "body": line["body"], "end": offset}
    if not seen and start == (0, 0):
        raise OpenAIError(400, "The file has no requests.", param="file", code="invalid_file")


def _bad_line(number: int, problem: str) -> OpenAIError:
    return OpenAIError(400, f"Line {number} of the file {problem}.", param="file", code="invalid_jsonl")
