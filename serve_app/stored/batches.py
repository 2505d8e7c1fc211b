"""OpenAI's Batch API: batch records in Redis, shared by every ingress replica.

A batch is a Redis hash per key (``redis_names.batch_record``): its fixed fields
as JSON, and its status, times, counts and usage as fields of their own, so the
runner (``batch_runner.py``) and a cancel can change them without overwriting
each other. Every status change goes through one script that changes it only
from the statuses allowed (a cancel racing the end of a batch either wins or
is told the batch already ended). A batch not yet ended holds a place in its
key's ``active_batches_of`` (its bound; the same slot as its record) and is in
``ACTIVE_BATCHES``, where runners find it. That one set serves every key, so a
write to it can be lost where a record's is not (a failover loses what the dying
primary had not replicated; an ingress can die between the two writes):
``reconcile`` makes it again from the keys' places, so no batch stays unrun.

Statuses as OpenAI's: validating → in_progress → finalizing → completed;
failed (its file does not hold valid requests for the endpoint); cancelling →
cancelled; expired (not done within its 24 h window).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Generator
from typing import Any, cast

from serve_app.accounting.storage_account import StorageAccount
from serve_app.errors import OpenAIError, shown
from serve_app.redis_store import redis_names
from serve_app.redis_store.redis_client import as_text
from serve_app.stored.files_api import FileStore, batch_lines
from serve_app.stored.listings import index_page
from serve_app.wire.api_requests import check_metadata

ENDPOINTS = {  # batch endpoint -> the gateway's operation
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
COMPLETION_WINDOWS = {"24h": 24 * 3600}
RECORD_RETENTION_S = 30 * 24 * 3600  # an ended batch's record, as its files
# A batch counts as active past its window for this long at most (its runner
# ends it; an entry whose ending was lost is forgotten after this).
_ACTIVE_HORIZON_S = 48 * 3600
# KEYS[1] the key's active batches; ARGV: batch id, now (s), bound, horizon (s).
# Takes a place among them for a new batch if the key has fewer than the bound.
_TAKE_ACTIVE_PLACE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[2]) - tonumber(ARGV[4]))
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""
# The most a batch's record holds: its fixed fields (metadata at OpenAI's bounds:
# ~9 kB), counts, times, and at most 100 errors whose echoed values are cut.
MAX_RECORD_BYTES = 64 * 1024
# How long a record counts in its key's account at most: its window, the horizon, its retention.
_RECORD_KEPT_S = COMPLETION_WINDOWS["24h"] + _ACTIVE_HORIZON_S + RECORD_RETENTION_S
# A place without a record is a creation still reading its file (200 MB at most)
# for this long at most; past it, one that never finished (its ingress died).
_CREATION_BOUND_S = 600
ENDED = ("completed", "failed", "expired", "cancelled")
_COUNTS = ("total", "completed", "failed")
_USAGE = ("input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens")
_TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")

# KEYS[1] the batch; ARGV: new status, now, then the statuses it may change from.
# Returns the status it had (unchanged unless that one is allowed), or false.
_TRANSITION = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return false end
for i = 3, #ARGV do
  if ARGV[i] == current then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[1] .. '_at', ARGV[2])
    return current
  end
end
return current
"""

# KEYS[1] the batch's lease. A parked batch (batch_runner.py) is free to claim again.
_UNPARK = """
if redis.call('GET', KEYS[1]) == 'parked' then return redis.call('DEL', KEYS[1]) end
return 0
"""


def not_found(batch_id: str) -> OpenAIError:
    return OpenAIError(404, f"No batch found with id '{batch_id}'.", param="batch_id", code="batch_not_found")


class BatchStore:
    def __init__(
        self,
        redis,
        files: FileStore | None,
        max_requests: int,
        max_active_per_key: int = 100,
        max_line_bytes: int = 8 * 1024 * 1024,
        records: StorageAccount | None = None,
    ):
        """``records``: the key's account of what it keeps in Redis, where each batch
        record counts (none: uncounted, for tools that only list and cancel)."""
        self.redis = redis
        self.files = files
        self.records = records
        self.max_requests = max_requests
        self.max_line_bytes = max_line_bytes  # a line is a request: the request body limit
        self.max_active_per_key = max_active_per_key
        self._transition = redis.register_script(_TRANSITION)
        self._unpark = redis.register_script(_UNPARK)
        self._take_active_place = redis.register_script(_TAKE_ACTIVE_PLACE)

    # -- the API ----------------------------------------------------------------

    def _files(self) -> FileStore:
        """The files a batch reads (a store built to list and cancel batches has none: llmctl's)."""
        if self.files is None:
            raise RuntimeError("this batch store reads no files")
        return self.files

    async def create(self, key_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """A new batch of ``body['input_file_id']``'s requests, or a 400 naming the
        parameter that is wrong. A file whose requests do not fit the endpoint makes
        a batch that failed, with one error per line, as OpenAI answers it."""
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise OpenAIError(
                400,
                f"Invalid 'endpoint': {shown(endpoint)}; one of {', '.join(ENDPOINTS)}.",
                param="endpoint",
                code="invalid_value",
            )
        window = body.get("completion_window")
        if window not in COMPLETION_WINDOWS:
            raise OpenAIError(
                400,
                f"Invalid 'completion_window': {shown(window)}; only '24h' is supported.",
                param="completion_window",
                code="invalid_value",
            )
        metadata = body.get("metadata")
        check_metadata(metadata)
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise OpenAIError(
                400,
                "'input_file_id' must be the id of a file uploaded with purpose 'batch'.",
                param="input_file_id",
                code="missing_required_parameter",
            )
        file = await self._files().get(key_id, file_id)
        if file["purpose"] != "batch":
            raise OpenAIError(
                400,
                f"File {file_id} has purpose {file['purpose']!r}; a batch needs one uploaded with purpose 'batch'.",
                param="input_file_id",
                code="invalid_value",
            )
        batch_id = "batch_" + uuid.uuid4().hex
        # A place among the key's active batches before its file is read (up to
        # 200 MB read here): a key cannot queue batches, or this work, without bound.
        active = redis_names.active_batches_of(key_id)
        if not await self._take_active_place(
            keys=[active], args=[batch_id, time.time(), self.max_active_per_key, _ACTIVE_HORIZON_S]
        ):
            raise OpenAIError(
                429,
                f"This key has {self.max_active_per_key} batches not yet ended, its limit. "
                "Wait for one to end, or cancel one.",
                code="too_many_active_batches",
            )
        try:
            if self.records is not None:  # its record's room, at most what a record can hold
                await self.records.reserve(key_id, batch_id, MAX_RECORD_BYTES, time.time() + _RECORD_KEPT_S)
            return await self._create(key_id, batch_id, endpoint, window, metadata, file_id)
        except BaseException:
            await asyncio.shield(self._not_made(key_id, batch_id))
            raise

    async def _not_made(self, key_id: str, batch_id: str) -> None:
        """A creation the client is told failed leaves no batch: whatever of it was written goes."""
        await self.redis.srem(redis_names.ACTIVE_BATCHES, f"{key_id}/{batch_id}")
        async with self.redis.pipeline(transaction=True) as pipe:  # one slot: the key's
            pipe.delete(redis_names.batch_record(key_id, batch_id))
            pipe.zrem(redis_names.batch_index(key_id), batch_id)
            pipe.zrem(redis_names.active_batches_of(key_id), batch_id)
            await pipe.execute()
        if self.records is not None:
            await self.records.release(key_id, batch_id)

    async def _create(self, key_id: str, batch_id: str, endpoint: str, window: str, metadata, file_id: str):
        total, errors = await asyncio.to_thread(self._scan, key_id, file_id, endpoint)
        now = int(time.time())
        fixed = {
            "id": batch_id,
            "object": "batch",
            "endpoint": endpoint,
            "input_file_id": file_id,
            "completion_window": window,
            "created_at": now,
            "expires_at": now + COMPLETION_WINDOWS[window],
            "metadata": metadata,
        }
        fields = {
            "fixed": json.dumps(fixed),
            "status": "failed" if errors else "validating",
            "total": total,
            "completed": 0,
            "failed": 0,
        }
        if errors:
            fields.update(failed_at=now, errors=json.dumps(errors))
        record = redis_names.batch_record(key_id, batch_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(record, mapping=fields)
            if errors:
                pipe.expire(record, RECORD_RETENTION_S)
            pipe.zadd(redis_names.batch_index(key_id), {batch_id: time.time()})
            pipe.zremrangebyscore(redis_names.batch_index(key_id), 0, time.time() - RECORD_RETENTION_S)
            # Outlives every record it lists (ended within the horizon, kept the retention), no longer.
            pipe.expire(redis_names.batch_index(key_id), RECORD_RETENTION_S + _ACTIVE_HORIZON_S)
            await pipe.execute()
        if self.records is not None:  # what it holds replaces its reservation
            size = sum(len(str(name)) + len(str(value)) for name, value in fields.items())
            await self.records.record(key_id, batch_id, size, time.time() + _RECORD_KEPT_S)
        if errors:  # ended at once
            await self.redis.zrem(redis_names.active_batches_of(key_id), batch_id)
        else:  # into the runners' set only once its record exists
            await self.redis.sadd(redis_names.ACTIVE_BATCHES, f"{key_id}/{batch_id}")
        return await self.get(key_id, batch_id)

    async def get(self, key_id: str, batch_id: str) -> dict[str, Any]:
        fields = await self.fields(key_id, batch_id)
        if fields is None:
            raise not_found(batch_id)
        return as_batch(fields)

    async def page(self, key_id: str, limit: int, after: str | None) -> dict[str, Any]:
        """One page of OpenAI's ListBatchesResponse, newest first."""

        async def load(batch_ids: list[str]) -> list[dict | None]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for batch_id in batch_ids:
                    pipe.hgetall(redis_names.batch_record(key_id, batch_id))
                return [
                    as_batch({as_text(k): as_text(v) for k, v in fields.items()}) if fields else None
                    for fields in await pipe.execute()
                ]

        data, has_more = await index_page(self.redis, redis_names.batch_index(key_id), load, limit, after=after)
        page = {"object": "list", "data": data, "has_more": has_more}
        if data:
            page.update(first_id=data[0]["id"], last_id=data[-1]["id"])
        return page

    async def cancel(self, key_id: str, batch_id: str) -> dict[str, Any]:
        """Ask the batch to stop: ``cancelling`` until a runner has written what
        ran (a parked batch is claimed again at once for it). 409 once it ended.
        The batch is put back in the runners' set too: a failover may have lost its
        entry there, and a cancel then waited for ``reconcile`` (up to its period,
        5 minutes) before a runner ended it (the soak saw it: a cancel answered 200,
        its batch not ended 60 s later). One a runner ended meanwhile is taken out
        again by the runner that finds it ended."""
        was = await self.transition(key_id, batch_id, "cancelling", ("validating", "in_progress"))
        if was is None:
            raise not_found(batch_id)
        if was not in ("validating", "in_progress", "cancelling"):
            raise OpenAIError(
                409,
                f"Batch {batch_id} is {was} and can no longer be cancelled.",
                param="batch_id",
                code="batch_not_cancellable",
            )
        await self._unpark(keys=[redis_names.batch_lease(key_id, batch_id)])
        await self.redis.sadd(redis_names.ACTIVE_BATCHES, f"{key_id}/{batch_id}")
        return await self.get(key_id, batch_id)

    async def active(self) -> list[tuple[str, str]]:
        """(key id, batch id) of every batch not ended yet, of every key."""
        members = [as_text(m) for m in await self.redis.smembers(redis_names.ACTIVE_BATCHES)]
        return sorted(cast(tuple[str, str], tuple(member.split("/", 1))) for member in members)

    async def key_of(self, batch_id: str) -> str:
        """The key of a batch not ended yet (what an admin cancels), or a 404."""
        for key_id, active_id in await self.active():
            if active_id == batch_id:
                return key_id
        raise not_found(batch_id)

    # -- what runners use ---------------------------------------------------------

    def lines(
        self, key_id: str, file_id: str, start: tuple[int, int] = (0, 0)
    ) -> Generator[dict[str, Any], None, None]:
        """The requests of ``file_id`` one at a time (``batch_lines``, from ``start``):
        blocking reads, for a thread; the file is opened at the first."""
        return batch_lines(self._files().path(key_id, file_id), self.max_requests, self.max_line_bytes, start)

    def _scan(self, key_id: str, file_id: str, endpoint: str) -> tuple[int, list[dict[str, Any]]]:
        """(how many requests ``file_id`` has, the first 100 whose url is not
        ``endpoint``), reading one line at a time."""
        total, errors = 0, cast(list[dict[str, Any]], [])
        for request in self.lines(key_id, file_id):
            total += 1
            if request["url"] != endpoint and len(errors) < 100:
                errors.append(
                    {
                        "code": "invalid_url",
                        "line": request["line"],
                        "param": "url",
                        "message": f"The request's url {shown(request['url'])} is not the batch's "
                        f"endpoint {endpoint!r}.",
                    }
                )
        return total, errors

    async def status(self, key_id: str, batch_id: str) -> str | None:
        """The batch's status now (None: no such batch)."""
        status = await self.redis.hget(redis_names.batch_record(key_id, batch_id), "status")
        return as_text(status) if status is not None else None

    async def fields(self, key_id: str, batch_id: str) -> dict[str, str] | None:
        fields = await self.redis.hgetall(redis_names.batch_record(key_id, batch_id))
        return {as_text(k): as_text(v) for k, v in fields.items()} if fields else None

    async def transition(self, key_id: str, batch_id: str, status: str, allowed: tuple[str, ...]) -> str | None:
        """Set ``status`` if the batch is in one of ``allowed``; the status it had (None: no such batch)."""
        was = await self._transition(
            keys=[redis_names.batch_record(key_id, batch_id)], args=[status, int(time.time()), *allowed]
        )
        return as_text(was) if was else None

    async def unstored(self, key_id: str, batch_id: str) -> dict[str, str]:
        """The batch's requests that ran and whose answers were not kept: custom_id -> why."""
        found = await self.redis.hgetall(redis_names.batch_unstored(key_id, batch_id))
        return {as_text(k): as_text(v) for k, v in found.items()}

    async def not_kept(self, key_id: str, batch_id: str, custom_id: str, why: str) -> None:
        """Remember that ``custom_id`` ran and its answer was not kept (never run again)."""
        name = redis_names.batch_unstored(key_id, batch_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(name, custom_id, why)
            pipe.expire(name, _RECORD_KEPT_S)  # as long as the batch's record
            await pipe.execute()

    async def update(self, key_id: str, batch_id: str, **fields: Any) -> None:
        await self.redis.hset(redis_names.batch_record(key_id, batch_id), mapping=fields)

    async def reconcile(self, now_s: float | None = None) -> dict[str, int]:
        """Make ``ACTIVE_BATCHES`` agree with the keys' places (SCAN over every
        node): a batch not ended is put back where runners find it; a place whose
        batch ended is given back; a place whose creation never finished (no record
        past ``_CREATION_BOUND_S``) is given back with its record's room. Returns how
        many of each it found."""
        now_s = time.time() if now_s is None else now_s
        found = {"restored": 0, "ended": 0, "unmade": 0}
        async for name in self.redis.scan_iter(match=redis_names.ACTIVE_BATCHES_OF_ANY_KEY, count=1000, _type="zset"):
            key_id = redis_names.key_of_active_batches(as_text(name))
            for member, created_s in await self.redis.zrange(name, 0, -1, withscores=True):
                batch_id = as_text(member)
                status = await self.status(key_id, batch_id)
                if status is None:
                    if now_s - created_s > _CREATION_BOUND_S:
                        await self._not_made(key_id, batch_id)
                        found["unmade"] += 1
                elif status in ENDED:
                    await self.ended(key_id, batch_id)
                    found["ended"] += 1
                elif await self.redis.sadd(redis_names.ACTIVE_BATCHES, f"{key_id}/{batch_id}"):
                    found["restored"] += 1
        return found

    async def ended(self, key_id: str, batch_id: str) -> None:
        """Out of the runners' set; the record is kept as long as its files."""
        await self.redis.expire(redis_names.batch_record(key_id, batch_id), RECORD_RETENTION_S)
        await self.redis.srem(redis_names.ACTIVE_BATCHES, f"{key_id}/{batch_id}")
        await self.redis.zrem(redis_names.active_batches_of(key_id), batch_id)


def as_batch(fields: dict[str, str]) -> dict[str, Any]:
    """OpenAI's Batch object from a batch's hash (fields never set are left out)."""
    batch = {k: v for k, v in json.loads(fields["fixed"]).items() if v is not None}
    batch["status"] = fields["status"]
    for name in _TIMES + ("output_file_id", "error_file_id", "model"):
        if name in fields:
            batch[name] = int(fields[name]) if name.endswith("_at") else fields[name]
    if "errors" in fields:
        batch["errors"] = {"object": "list", "data": json.loads(fields["errors"])}
    batch["request_counts"] = {name: int(fields.get(name, 0)) for name in _COUNTS}
    tokens = {name: int(fields.get(name, 0)) for name in _USAGE}
    batch["usage"] = {
        "input_tokens": tokens["input_tokens"],
        "input_tokens_details": {"cached_tokens": tokens["cached_tokens"]},
        "output_tokens": tokens["output_tokens"],
        "output_tokens_details": {"reasoning_tokens": tokens["reasoning_tokens"]},
        "total_tokens": tokens["input_tokens"] + tokens["output_tokens"],
    }
    return batch
