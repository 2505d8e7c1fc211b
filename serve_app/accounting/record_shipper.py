"""Final request records from settlement to the record sink (record_sink.py), through Redis.

Settlement (settle.lua) leaves a final record in Redis for ``records.recent_s``
and hands it back; ``ship`` adds it to one Redis stream (``redis_names.RECORD_OUTBOX``),
the bounded buffer between settlement and the sink. Every process that settles
(ingress replicas, direct routes) runs a shipper in the stream's consumer group: it
reads a batch, appends it to its own files, flushed to disk, then acknowledges and
deletes the entries. A batch its sink refused (a full disk, a share gone) stays
pending for this shipper and is written again next time; a shipper that died with
entries read leaves them to another, which claims them after ``CLAIM_IDLE_MS`` (a
record may so be written twice; lookups take the first).

Back-pressure: past ``records.max_backlog`` entries waiting, the shippers say
``backlogged`` and ``Gatekeeper.admit`` refuses new requests (503 ``records_backlog``)
until the sink takes them, so a sink that is down never loses a record nor grows
Redis past the bound (requests in flight still settle into it).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import socket
import time
import uuid
from typing import Any

from redis.exceptions import RedisError, ResponseError

from serve_app.accounting.record_sink import RecordSink
from serve_app.redis_store import redis_names
from serve_app.redis_store.auto_pipeline import AutoPipeline

logger = logging.getLogger("ray.serve")

GROUP = "shippers"
BATCH = 500  # entries read and written at a time
IDLE_S = 0.5  # between reads of an empty outbox
RETRY_S = 2.0  # after the sink or Redis failed
CLAIM_IDLE_MS = 60_000  # an entry read this long ago and never acknowledged: its shipper died
CLAIM_EVERY_S = 10.0  # how often a shipper looks for such entries
SWEEP_EVERY_S = 3600.0
MAX_UNSENT = 10_000  # records ``ship`` could not add (Redis failed), kept here for the loop to add


class RecordShipper:
    def __init__(self, redis, sink: RecordSink, max_backlog: int, telemetry=None, writer: str | None = None):
        self.redis = redis
        self.sink = sink
        self.max_backlog = max_backlog
        self.telemetry = telemetry
        self.writer = writer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.backlog = 0  # the outbox's length, as last read
        self._unsent: collections.deque[str] = collections.deque()
        self._group_ready = False
        self._own_pending = False  # entries read and not acknowledged (the sink refused them)
        self._claimed_at = float("-inf")
        self._task: asyncio.Task | None = None
        # The turn's pipeline (auto_pipeline.py) a record is added through, beside the
        # settlement that made it: no write of its own per request (ship_through).
        self._pipeline: AutoPipeline | None = None

    def ship_through(self, pipeline: AutoPipeline) -> None:
        self._pipeline = pipeline

    @property
    def backlogged(self) -> bool:
        """Whether the outbox is full: new requests wait until the sink takes records."""
        return self.backlog >= self.max_backlog

    async def ship(self, record: dict[str, Any]) -> None:
        """Hand a final record to the sink, through the outbox (one XADD)."""
        entry = json.dumps(record, separators=(",", ":"))
        try:
            if self._pipeline is not None:
                await self._pipeline.command("XADD", redis_names.RECORD_OUTBOX, "*", "r", entry)
            else:
                await self.redis.xadd(redis_names.RECORD_OUTBOX, {"r": entry})
        except RedisError:
            if len(self._unsent) >= MAX_UNSENT:
                logger.error(
                    "request record %s lost: Redis refused it and %d wait already", record.get("id"), MAX_UNSENT
                )
                self._failed("lost")
                return
            self._unsent.append(entry)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run_forever())

    async def run_forever(self) -> None:
        last_sweep = 0.0
        while True:
            try:
                shipped = await self.ship_once()
                if time.monotonic() - last_sweep >= SWEEP_EVERY_S:
                    last_sweep = time.monotonic()
                    await asyncio.to_thread(self.sink.sweep, time.time())
            except (RedisError, OSError) as exc:
                logger.warning("request records not shipped yet (%s: %s); retrying", type(exc).__name__, exc)
                self._failed("redis" if isinstance(exc, RedisError) else "sink")
                await asyncio.sleep(RETRY_S)
                continue
            except Exception:
                logger.exception("request record shipping failed; retrying")
                await asyncio.sleep(RETRY_S)
                continue
            if not shipped:
                await asyncio.sleep(IDLE_S)

    async def ship_once(self) -> int:
        """Move one batch from the outbox to the sink: this shipper's own pending
        entries first (written again), then entries another shipper left behind,
        then new ones. Returns how many were written."""
        await self._add_unsent()
        await self._ensure_group()
        entries = []
        if self._own_pending:  # what the sink refused last time, first
            entries = await self._read("0")
            self._own_pending = bool(entries)
        if not entries and time.monotonic() - self._claimed_at >= CLAIM_EVERY_S:
            self._claimed_at = time.monotonic()
            entries = await self._claim()
        if not entries:
            entries = await self._read(">")
        if entries:
            records = [json.loads(fields[b"r"] if b"r" in fields else fields["r"]) for _, fields in entries]
            self._own_pending = True  # read: pending for this shipper until acknowledged
            written = await asyncio.to_thread(self.sink.append, self.writer, records)
            ids = [entry_id for entry_id, _ in entries]
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xack(redis_names.RECORD_OUTBOX, GROUP, *ids)
                pipe.xdel(redis_names.RECORD_OUTBOX, *ids)
                await pipe.execute()
            self._own_pending = False
            if self.telemetry is not None:
                self.telemetry.records_shipped(len(records), written)
        self.backlog = int(await self.redis.xlen(redis_names.RECORD_OUTBOX))
        if self.telemetry is not None:
            self.telemetry.records_backlog(self.backlog)
        return len(entries)

    async def _add_unsent(self) -> None:
        while self._unsent:
            await self.redis.xadd(redis_names.RECORD_OUTBOX, {"r": self._unsent[0]})
            self._unsent.popleft()

    async def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            await self.redis.xgroup_create(redis_names.RECORD_OUTBOX, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    async def _read(self, start: str) -> list:
        try:
            reply = await self.redis.xreadgroup(GROUP, self.writer, {redis_names.RECORD_OUTBOX: start}, count=BATCH)
        except ResponseError as exc:
            if "NOGROUP" in str(exc):  # the stream was removed (a flushed Redis): made again next time
                self._group_ready = False
                return []
            raise
        if not reply:
            return []
        _, entries = reply[0] if isinstance(reply, list) else next(iter(reply.items()))
        return [(entry_id, fields) for entry_id, fields in entries if fields]  # deleted meanwhile: no fields

    async def _claim(self) -> list:
        reply = await self.redis.xautoclaim(
            redis_names.RECORD_OUTBOX, GROUP, self.writer, CLAIM_IDLE_MS, start_id="0-0", count=BATCH
        )
        return [(entry_id, fields) for entry_id, fields in reply[1] if fields]

    def _failed(self, kind: str) -> None:
        if self.telemetry is not None:
            self.telemetry.records_ship_failed(kind)
