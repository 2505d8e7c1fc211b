"""Runs batches (``batches.py``) in the ingress replicas, in idle capacity.

Every ingress replica runs one ``BatchRunner``. It runs up to
``batch.batches_at_once`` batches side by side, at most ``batch.batches_per_key``
of one key, each taken from ``ACTIVE_BATCHES`` under a Redis lease (one runner
per batch at a time): a key with many batches takes one place here, and the
other keys' batches the rest. Each batch's requests go through ``Gateway.run``
like any client's, as the key is *now*: its record is read again before every
request, so a key revoked or disabled, a model taken away or a limit lowered
applies to the batch's next request. Batch requests are background requests:
ranked after every key's tier (vLLM's priority where the model schedules by
priority, the fair-share queue, the model's queue), at most ``concurrency`` at a
time per batch, and each sent only while no interactive request of its model
waits at this ingress.

A batch whose key is refused (a 429: a rate limit, a budget, its concurrency) is
parked: its runner stops sending, gives up its place and leaves the lease to say
"parked" until the refusal may pass (``MAX_PARK_S`` at most), so no runner holds
a place for a batch that cannot proceed. A cancel ends a parked batch's wait.
A batch whose key was revoked or disabled stops: its requests not yet run are
error lines (``api_key_revoked``) and it ends ``cancelled``.

Results are appended to the batch's partial output and error files in the
files directory, under the lease. They are the batch's progress: a runner that
takes a batch over (its runner's ingress restarted or died; the lease expired;
it was parked) reads them, skips every ``custom_id`` already answered and runs
the rest. A request that was running when its runner died is run again (and
charged again: its first run's answer was never written). A busy model (503) is
retried until the batch's window ends; any other error is the request's line in
the error file, with the status and body a client would have got.

Results are storage: each line's bytes are counted against its key's files
(``batch.max_bytes_per_key``) before it is written, so a batch's results never
take its key past the bound. A line that does not fit is not kept: the batch
stops there, its requests not run count as failed, and its ``errors`` name the
bound. A line that cannot be written (the files' disk full) is not kept either,
and the batch parks until the disk may have room. Either request ran and was
charged once: it is remembered (``batch_unstored``) and never run again.

A parked batch resumes where it stopped: each claim saves where the input's lines
answered in order end (``resume_at``), and the next reads from there, never
parsing them again. A request refused before its admission (an unknown model, a
bad parameter) still counts as one of its key's requests (admitted with no
tokens), so a batch of them is never free: a key without room parks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from contract.replica_wire import Usage
from serve_app.admission.seam import Refusal
from serve_app.appends import append_whole
from serve_app.errors import OpenAIError
from serve_app.identity.keys import KeyRecord, KeyStore
from serve_app.pipeline.gateway import Gateway
from serve_app.pipeline.refusals import render as render_refusal
from serve_app.redis_store import redis_names
from serve_app.redis_store.redis_client import as_text
from serve_app.settings import BatchConfig
from serve_app.stored.batches import ENDED, ENDPOINTS, BatchStore
from serve_app.stored.files_api import FileStore
from serve_app.telemetry import RequestRecord, Telemetry
from serve_app.tracing import RequestTrace

logger = logging.getLogger("ray.serve")

MAX_RETRY_WAIT_S = 30.0
# A parked batch is looked at again after this at most (a budget that renews
# tomorrow still gets one admission a minute, not a runner's place all day).
MAX_PARK_S = 60.0
SWEEP_EVERY_S = 600.0
# A claim sends nothing while the files' disk has less free than this: an answer
# it could not write would have run, and been charged, for nothing.
MIN_FREE_BYTES = 64 * 1024
# Input lines read ahead of the requests sent (each at most the body limit).
_READ_AHEAD = 8

# KEYS[1] the lease; ARGV: owner, ms. Renews the lease only if it is still ours.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
# KEYS[1] the lease; ARGV: owner. Gives it up only if it is ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS[1] the lease; ARGV: owner, ms. Turns our lease into the mark 'parked' for ms (batches.py _UNPARK clears it).
_PARK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('SET', KEYS[1], 'parked', 'PX', ARGV[2]) end
return 0
"""


def result_file_id(batch_id: str, kind: str) -> str:
    """The id a batch's output or error file gets: fixed by the batch, so a runner
    that resumes a batch's finalization makes the same file, never a second one."""
    return "file-" + uuid.uuid5(uuid.NAMESPACE_URL, f"llm-cluster:{batch_id}:{kind}").hex


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        files: FileStore,
        gateway: Gateway,
        keys: KeyStore,
        telemetry: Telemetry,
        config: BatchConfig,
    ):
        self.store, self.files, self.gateway, self.keys = store, files, gateway, keys
        self.telemetry, self.config = telemetry, config
        self.redis = keys.redis
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._renew = self.redis.register_script(_RENEW)
        self._release = self.redis.register_script(_RELEASE)
        self._park = self.redis.register_script(_PARK)
        self._task: asyncio.Task | None = None
        self._swept_at = 0.0
        self._reconciled_at = 0.0
        self._jobs: dict[str, asyncio.Task] = {}  # batch id -> its job, running here
        self._per_key: dict[str, int] = {}  # key id -> its batches running here

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self.run_forever())

    async def run_forever(self) -> None:
        while True:
            try:
                await self._fill()
                if time.monotonic() - self._swept_at > SWEEP_EVERY_S:  # however busy: expired content goes
                    self._swept_at = time.monotonic()
                    await self.files.sweep()
                # Each replica asks four times a period: the claim's holder reconciles within it.
                if time.monotonic() - self._reconciled_at > self.config.reconcile_s / 4:
                    self._reconciled_at = time.monotonic()
                    await self._reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("batch runner: error")
            await asyncio.sleep(self.config.poll_s * random.uniform(0.5, 1.5))

    async def _fill(self) -> None:
        """Claim batches until ``batches_at_once`` run here, at most
        ``batches_per_key`` of one key; each runs as a task of its own."""
        if len(self._jobs) >= self.config.batches_at_once:
            return
        members = [as_text(m) for m in await self.redis.smembers(redis_names.ACTIVE_BATCHES)]
        random.shuffle(members)
        for member in members:
            key_id, _, batch_id = member.partition("/")
            if len(self._jobs) >= self.config.batches_at_once:
                return
            if batch_id in self._jobs or self._per_key.get(key_id, 0) >= self.config.batches_per_key:
                continue
            if await self.redis.set(
                redis_names.batch_lease(key_id, batch_id), self.owner, nx=True, px=int(self.config.lease_s * 1000)
            ):
                self._per_key[key_id] = self._per_key.get(key_id, 0) + 1
                task = asyncio.ensure_future(self._run_leased(key_id, batch_id))
                self._jobs[batch_id] = task
                task.add_done_callback(functools.partial(self._job_ended, key_id, batch_id))

    async def _reconcile(self) -> None:
        """Once per ``reconcile_s`` of all replicas (the first to claim the period;
        the claim expires with it, so a replica that dies holding it delays the next by none):
        the runners' set made again from the keys' places (``BatchStore.reconcile``)."""
        period_ms = int(self.config.reconcile_s * 1000)
        if not await self.redis.set(redis_names.BATCH_RECONCILER, self.owner, nx=True, px=period_ms):
            return
        found = await self.store.reconcile()
        if any(found.values()):
            logger.warning("batch runner: reconciled the runners' set: %s", found)

    def _job_ended(self, key_id: str, batch_id: str, _: asyncio.Task) -> None:
        self._jobs.pop(batch_id, None)
        self._per_key[key_id] -= 1
        if not self._per_key[key_id]:
            del self._per_key[key_id]

    async def _run_leased(self, key_id: str, batch_id: str) -> None:
        lease = redis_names.batch_lease(key_id, batch_id)
        job = BatchJob(self, key_id, batch_id)
        renewer = asyncio.ensure_future(self._keep_lease(lease, job))
        try:
            await job.run()
        except Exception:
            logger.exception("batch %s: error; another claim resumes it", batch_id)
        finally:
            renewer.cancel()
            try:
                if job.park_s is not None:  # no place held while it cannot proceed
                    await self._park(keys=[lease], args=[self.owner, max(1, int(job.park_s * 1000))])
                else:
                    await self._release(keys=[lease], args=[self.owner])
            except Exception:  # it expires by itself
                logger.warning("batch %s: could not release its lease", batch_id)

    async def _keep_lease(self, lease: str, job: BatchJob) -> None:
        every = self.config.lease_s / 3
        while True:
            await asyncio.sleep(every)
            try:
                renewed = await self._renew(keys=[lease], args=[self.owner, int(self.config.lease_s * 1000)])
            except Exception:
                logger.warning("batch %s: lease renewal failed", job.batch_id)
                continue  # the next try may pass; past the lease, another runner takes it
            if not renewed:
                logger.warning("batch %s: lease lost; another runner resumes it", job.batch_id)
                job.lost = True
                return


class BatchJob:
    """One batch, run by the runner holding its lease."""

    def __init__(self, runner: BatchRunner, key_id: str, batch_id: str):
        self.runner, self.key_id, self.batch_id = runner, key_id, batch_id
        self.store, self.files = runner.store, runner.files
        self.lost = False
        self.out = self.files.partial_path(key_id, batch_id + ".output")
        self.err = self.files.partial_path(key_id, batch_id + ".errors")
        self.counts = {
            "completed": 0,
            "failed": 0,
            "input_tokens": 0,
            "cached_tokens": 0,
            "output_tokens": 0,
            "reasoning_tokens": 0,
        }
        self.ends = "completed"  # or expired: some requests never ran within the window
        self.park_s: float | None = None  # set by a refusal of the key: how long the batch waits, parked
        self.key_gone = False  # the key was revoked or disabled: the batch stops
        self.input_lost: Exception | None = None  # its input file was deleted or changed while it ran
        self.unstored: dict[str, str] = {}  # custom_id -> why its answer, which ran, was not kept
        self.at_bound = False  # a line did not fit its key's storage bound: the batch stops
        # Where this claim reads the input from: every line before it is answered (a
        # parked batch's next claim never parses them again); the lines read since, and
        # the custom_ids answered by this claim, for the next claim's start.
        self.start: tuple[int, int] = (0, 0)
        self._read: list[tuple[str, int, int]] = []
        self._answered_now: set[str] = set()

    async def run(self) -> None:
        fields = await self.store.fields(self.key_id, self.batch_id)
        if fields is None or fields["status"] in ENDED:
            await self.store.ended(self.key_id, self.batch_id)
            return
        fixed = json.loads(fields["fixed"])
        self.expires_at = fixed["expires_at"]
        self.unstored = await self.store.unstored(self.key_id, self.batch_id)
        if fields.get("resume_at"):
            offset, line = fields["resume_at"].split(",")
            self.start = (int(offset), int(line))
        self.at_bound = STORAGE_BOUND in self.unstored.values()
        if fields["status"] == "validating":
            await self.store.transition(self.key_id, self.batch_id, "in_progress", ("validating",))
        if fields["status"] != "finalizing":
            file_id = fixed["input_file_id"]
            if not await asyncio.to_thread(self._disk_has_room):
                logger.error("batch %s: the files' disk is full; the batch parks", self.batch_id)
                self.park_s = MAX_PARK_S
                return
            done = await asyncio.to_thread(self._answered)
            await self.store.update(self.key_id, self.batch_id, **self.counts)
            # The input file is read as the requests are sent, a few lines ahead:
            # a runner holds its batches' requests in flight, never their files.
            await self._send_all(ENDPOINTS[fixed["endpoint"]], self._unanswered(file_id, done))
            await self._save_start(done)
            if self.input_lost is not None:
                return await self._input_lost(self.input_lost)
            if self.lost:
                return
            if self.key_gone:  # its work stops: what did not run is cancelled
                await self.store.transition(self.key_id, self.batch_id, "cancelling", ("in_progress",))
            status = await self.store.status(self.key_id, self.batch_id)
            if status == "in_progress" and self.park_s is not None and time.time() < self.expires_at:
                return  # parked: a later claim sends the rest
            self.park_s = None
            if status == "cancelling":
                code = "api_key_revoked" if self.key_gone else "batch_cancelled"
            elif self.at_bound:
                code = STORAGE_BOUND
            elif time.time() >= self.expires_at:
                code = "batch_expired"
            else:
                code = None
            try:
                not_run = await asyncio.to_thread(self._not_run, file_id, code)
            except (OSError, OpenAIError) as exc:
                return await self._input_lost(exc)
            if not_run and code is None:  # answers that could not be written (a full disk): run again
                logger.warning("batch %s: %d requests unanswered; it will be resumed", self.batch_id, not_run)
                return
            if not_run and code == "batch_expired":
                self.ends = "expired"
            if code == STORAGE_BOUND:  # no error lines for them (no room): the count is kept for the record
                await self.store.update(self.key_id, self.batch_id, not_run_at_bound=not_run)
        await self._finalize()

    async def _unanswered(self, file_id: str, done: set[str]) -> AsyncGenerator[dict[str, Any], None]:
        """The requests of the input file not in ``done``, read off the event loop
        ``_READ_AHEAD`` at a time. A file gone or changed meanwhile ends them and
        sets ``input_lost``."""
        lines = self.store.lines(self.key_id, file_id, self.start)

        def read(request: dict[str, Any]) -> bool:
            self._read.append((request["custom_id"], request["end"], request["line"]))
            return request["custom_id"] not in done

        def ahead() -> list[dict[str, Any]]:
            return list(itertools.islice(filter(read, lines), _READ_AHEAD))

        try:
            while chunk := await asyncio.to_thread(ahead):
                for request in chunk:
                    yield request
        except (OSError, OpenAIError) as exc:  # the input file was deleted (or replaced) meanwhile
            self.input_lost = exc
        finally:
            with contextlib.suppress(ValueError):  # cancelled while a thread reads it: closed when collected
                lines.close()

    async def _save_start(self, done: set[str]) -> None:
        """Where the next claim reads from: past the lines read in order that are all
        answered (before this claim or by it)."""
        await asyncio.to_thread(self._sync_partials)  # what the resume point passes is on the disk
        start = self.start
        for custom_id, end, line in self._read:
            if custom_id not in done and custom_id not in self._answered_now:
                break
            start = (end, line)
        if start != self.start and not self.lost:
            self.start = start
            await self.store.update(self.key_id, self.batch_id, resume_at=f"{start[0]},{start[1]}")

    def _sync_partials(self) -> None:
        for path in (self.out, self.err):
            if path.exists():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def _not_run(self, file_id: str, code: str | None) -> int:
        """How many of the input file's requests are unanswered; with ``code``
        (cancelled, expired, the key revoked), each is written as a line of the
        error file saying why it never ran."""
        answered = self._answered()
        count = 0
        for request in self.store.lines(self.key_id, file_id, self.start):  # every line before it is answered
            if request["custom_id"] in answered:
                continue
            count += 1
            if code in _NOT_RUN:  # at the storage bound, no line more is written: the batch's errors say so
                self._write(self.err, self._error_line(request, code, _NOT_RUN[code]))
        if code is not None:
            self.counts["failed"] += count
        return count

    async def _input_lost(self, exc: Exception) -> None:
        """The batch fails: its input file was deleted or changed while it ran."""
        message = exc.message if isinstance(exc, OpenAIError) else "The input file is no longer available."
        await self.store.update(
            self.key_id,
            self.batch_id,
            errors=json.dumps(
                [{"code": "invalid_input_file", "message": message, "param": "input_file_id", "line": None}]
            ),
        )
        await self.store.transition(self.key_id, self.batch_id, "failed", ("validating", "in_progress", "cancelling"))
        await self.store.ended(self.key_id, self.batch_id)
        # Results of a batch that failed: never a file, and the room they took is given back.
        for partial, kind in ((self.out, "output"), (self.err, "errors")):
            partial.unlink(missing_ok=True)
            await self.files.release_result(self.key_id, result_file_id(self.batch_id, kind))

    async def _key(self) -> KeyRecord | None:
        """The batch's key as it is now; None once revoked or disabled."""
        return await self.runner.keys.active(self.key_id)

    def _disk_has_room(self) -> bool:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        stats = os.statvfs(self.out.parent)
        return stats.f_bavail * stats.f_frsize >= MIN_FREE_BYTES

    def _answered(self) -> set[str]:
        """custom_ids already answered (in either partial file, or run and not kept),
        with the counts and usage they add up to. A line cut short by a crash is removed."""
        done: set[str] = set(self.unstored)
        self.counts = dict.fromkeys(self.counts, 0)
        self.counts["failed"] = len(done)
        for path, counter in ((self.out, "completed"), (self.err, "failed")):
            if not path.exists():
                continue
            with open(path, "rb+") as lines:
                good = 0
                for raw in lines:
                    if not raw.endswith(b"\n"):
                        break
                    try:
                        line = json.loads(raw)
                    except ValueError:  # not a line this runner wrote whole: cut there, as a crash's
                        logger.error("batch %s: a result line is not JSON; cut there", self.batch_id)
                        break
                    if line["custom_id"] not in done:
                        done.add(line["custom_id"])
                        self.counts[counter] += 1
                        self._add_usage(line)
                    good += len(raw)
                lines.truncate(good)
        return done

    def _add_usage(self, line: dict[str, Any]) -> None:
        response = line.get("response") or {}
        usage = (response.get("body") or {}).get("usage") if isinstance(response.get("body"), dict) else None
        if not isinstance(usage, dict):
            return
        self.counts["input_tokens"] += usage.get("prompt_tokens") or 0
        self.counts["output_tokens"] += usage.get("completion_tokens") or 0
        self.counts["cached_tokens"] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        self.counts["reasoning_tokens"] += (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0

    async def _next_key(self) -> KeyRecord | None:
        """The key to send the next request for, read now, or None when the batch
        stops sending: its lease lost, its window over, cancelled (the status is
        read before every request: a cancel stops it within the requests in
        flight), parked, or its key revoked or disabled."""
        if self.lost or self.park_s is not None or self.at_bound or time.time() >= self.expires_at:
            return None
        if await self.store.status(self.key_id, self.batch_id) != "in_progress":
            return None
        key = await self._key()
        if key is None:
            self.key_gone = True
        return key

    async def _send_all(self, operation: str, pending: AsyncGenerator[dict[str, Any], None]) -> None:
        slots = asyncio.Semaphore(self.runner.config.concurrency)
        running: set[asyncio.Task] = set()
        try:
            async for request in pending:
                await slots.acquire()
                await self._yield_to_interactive(request["body"].get("model"))
                key = await self._next_key()
                if key is None:
                    slots.release()
                    break
                task = asyncio.ensure_future(self._guarded(key, operation, request))
                running.add(task)
                task.add_done_callback(functools.partial(_ended, running, slots))
        finally:
            await pending.aclose()
            if running:
                await asyncio.gather(*running, return_exceptions=True)

    async def _yield_to_interactive(self, model: Any) -> None:
        """Wait while interactive requests of ``model`` wait for a replica here."""
        try:
            name = self.runner.gateway.catalog.resolve(model) if isinstance(model, str) else None
        except OpenAIError:
            return  # the request's own error says so
        while name is not None and self.runner.gateway.waiting(name) > 0 and not self.lost:
            await asyncio.sleep(0.05)

    async def _guarded(self, key: KeyRecord, operation: str, request: dict[str, Any]) -> None:
        """``_one``, whose failure to keep an answer (Redis or the disk refusing what
        records it) parks the batch rather than passing unseen: the request is not
        counted as answered, so the resume point never passes it."""
        try:
            await self._one(key, operation, request)
        except Exception:
            logger.exception(
                "batch %s: request %s: its answer was not kept; the batch parks", self.batch_id, request["custom_id"]
            )
            self.park_s = max(self.park_s or 0.0, MAX_RETRY_WAIT_S)

    async def _one(self, key: KeyRecord, operation: str, request: dict[str, Any]) -> None:
        line_id = "batch_req_" + uuid.uuid4().hex
        if request["body"].get("stream"):
            error = OpenAIError(400, "Streaming is not supported in a batch.", param="stream", code="invalid_value")
            if await self._counted(key, line_id):
                await self._answer(request, self._failed_line(request, line_id, error))
            return
        while True:
            body = json.loads(json.dumps(request["body"]))  # the gateway edits what it is given
            # A batch line traces as a request does, its own trace (no client context).
            record = RequestRecord("batch", line_id, trace=RequestTrace.start(f"batch {operation}", {}))
            record.for_key(key)
            try:
                reply = await self.runner.gateway.run(
                    key, operation, body, len(json.dumps(body)), record, background=True
                )
            except OpenAIError as exc:
                record.refused(exc.status, exc.code, exc.type, exc.headers)
                self.runner.telemetry.finish(record)
                wait = _retry_after_s(exc)
                if wait is not None and exc.status == 429:
                    # The key cannot go on now (a limit, a budget): the batch waits, parked,
                    # and this request stays unanswered for the claim that resumes it.
                    self.park_s = max(self.park_s or 0.0, min(wait, MAX_PARK_S))
                    return
                fresh = await self._next_key() if wait is not None else None
                if fresh is not None:  # a busy model: the same request again shortly, as the key is then
                    await asyncio.sleep(min(wait, MAX_RETRY_WAIT_S, max(0.0, self.expires_at - time.time())))
                    key = fresh
                    continue
                if wait is not None:
                    return  # stopping: the request stays unanswered (cancelled, expired or parked)
                # Counted already: admitted, or refused by admission itself (a request too large).
                if record.admitted_at is not None or exc.status == 429 or await self._counted(key, line_id):
                    await self._answer(request, self._failed_line(request, line_id, exc))
                return
            except Exception:
                logger.exception("batch %s: request %s failed", self.batch_id, request["custom_id"])
                record.status = 500
                self.runner.telemetry.finish(record)
                error = OpenAIError(500, "The server had an error processing this request.")
                return await self._answer(request, self._failed_line(request, line_id, error))
            record.status = 200
            self.runner.telemetry.finish(record)
            answer = reply.json()
            line = {
                "id": line_id,
                "custom_id": request["custom_id"],
                "response": {"status_code": 200, "request_id": line_id, "body": answer},
                "error": None,
            }
            return await self._answer(request, line, ok=True)

    async def _answer(self, request: dict[str, Any], line: dict[str, Any], ok: bool = False) -> None:
        """Keep ``line``, the answer of ``request``: counted against its key's files, then
        written; or, if its key's bound cannot hold it or the disk will not take it,
        remembered as run and not kept (the batch stops, or parks)."""
        if self.lost:  # another runner has the batch now: it runs this request again
            return
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        result = result_file_id(self.batch_id, "output" if ok else "errors")
        if not await self.files.grow_result(self.key_id, result, len(data)):
            self.at_bound = True
            return await self._not_kept(request, STORAGE_BOUND)
        if self.lost:  # lost while Redis counted it: the runner that has the batch now runs it
            return await self.files.grow_result(self.key_id, result, -len(data))
        try:
            self._append(self.out if ok else self.err, data)
        except OSError as exc:
            logger.error("batch %s: an answer could not be written (%s); the batch parks", self.batch_id, exc)
            self.park_s = MAX_PARK_S
            await self.files.grow_result(self.key_id, result, -len(data))  # not on the disk: not counted
            return await self._not_kept(request, "result_not_stored")
        self.counts["completed" if ok else "failed"] += 1
        self._answered_now.add(request["custom_id"])
        self._add_usage(line)
        asyncio.ensure_future(self._save_counts())

    async def _counted(self, key: KeyRecord, line_id: str) -> bool:
        """A request that failed before its admission (an unknown model, a bad
        parameter) still counts as one of its key's requests (admitted with no tokens,
        as the Files routes are), so a batch of them is never free work: True; False
        when the key has no room now (the batch parks, the line waits for a later claim)."""
        gate = self.runner.gateway.access
        try:
            ticket = await gate.admit(key, "", 0, line_id)
        except OpenAIError:  # Redis cannot say now: a later claim
            self.park_s = max(self.park_s or 0.0, 1.0)
            return False
        if isinstance(ticket, Refusal):
            wait = _retry_after_s(render_refusal(ticket))
            self.park_s = max(self.park_s or 0.0, min(wait if wait is not None else MAX_PARK_S, MAX_PARK_S))
            return False
        gate.settle(ticket, "failed", Usage())
        return True

    async def _not_kept(self, request: dict[str, Any], why: str) -> None:
        """``request`` ran (and was charged) but its answer is not kept: remembered, so
        that no claim runs it again, and counted as failed."""
        await self.store.not_kept(self.key_id, self.batch_id, request["custom_id"], why)  # first: then it is past
        self.unstored[request["custom_id"]] = why
        self._answered_now.add(request["custom_id"])
        self.counts["failed"] += 1
        asyncio.ensure_future(self._save_counts())

    async def _save_counts(self) -> None:
        try:
            await self.store.update(self.key_id, self.batch_id, **self.counts)
        except Exception:
            logger.warning("batch %s: could not save its counts", self.batch_id)

    @staticmethod
    def _failed_line(request: dict[str, Any], line_id: str, exc: OpenAIError) -> dict[str, Any]:
        return {
            "id": line_id,
            "custom_id": request["custom_id"],
            "response": {"status_code": exc.status, "request_id": line_id, "body": exc.body()},
            "error": None,
        }

    @staticmethod
    def _error_line(request: dict[str, Any], code: str, message: str) -> dict[str, Any]:
        return {
            "id": "batch_req_" + uuid.uuid4().hex,
            "custom_id": request["custom_id"],
            "response": None,
            "error": {"code": code, "message": message},
        }

    @staticmethod
    def _write(path: Path, line: dict[str, Any]) -> None:
        BatchJob._append(path, (json.dumps(line, separators=(",", ":")) + "\n").encode())

    @staticmethod
    def _append(path: Path, data: bytes) -> None:
        """Append ``data`` whole or not at all: a write the disk refused part-way is
        taken back, so a later line never lands after a cut one."""
        path.parent.mkdir(parents=True, exist_ok=True)
        append_whole(path, data)

    async def _finalize(self) -> None:
        """The partial files become the batch's output and error files, then the
        batch ends: completed, cancelled (it was cancelling) or expired. Safe to
        run again after a crash: the files' ids are fixed by the batch."""
        was = await self.store.transition(self.key_id, self.batch_id, "finalizing", ("in_progress",))
        ends = {"cancelling": "cancelled"}.get(was or "", self.ends)
        await asyncio.to_thread(self._answered)  # the counts as written
        fields = await self.store.fields(self.key_id, self.batch_id) or {}
        self.counts["failed"] += int(fields.get("not_run_at_bound", 0))  # not run: the storage bound was reached
        files = {}
        for path, kind, field in ((self.out, "output", "output_file_id"), (self.err, "errors", "error_file_id")):
            file_id = result_file_id(self.batch_id, kind)
            if path.exists() or self.files.path(self.key_id, file_id).exists():
                await self.files.adopt(self.key_id, path, f"{self.batch_id}_{kind}.jsonl", "batch_output", file_id)
                files[field] = file_id
            else:  # no such result: what its lines' room counted is given back
                await self.files.release_result(self.key_id, file_id)
        errors = self._unstored_errors()
        await self.store.update(self.key_id, self.batch_id, **files, **self.counts, **errors)
        await self.store.transition(self.key_id, self.batch_id, ends, ("finalizing", "cancelling", "in_progress"))
        await self.store.ended(self.key_id, self.batch_id)

    def _unstored_errors(self) -> dict[str, str]:
        """The batch's ``errors`` naming why answers that ran were not kept (none: {})."""
        errors = []
        if self.at_bound:
            errors.append(
                {
                    "code": STORAGE_BOUND,
                    "message": f"The batch stopped at its key's file storage bound ({self.files.space.max_bytes} "
                    "bytes): the answer that did not fit was not kept and no request after it ran. Delete files "
                    "to make room.",
                    "param": None,
                    "line": None,
                }
            )
        lost = sum(why == "result_not_stored" for why in self.unstored.values())
        if lost:
            errors.append(
                {
                    "code": "result_not_stored",
                    "message": f"{lost} answers could not be written (the server's file storage was full); "
                    "they ran and were charged once, and were not run again.",
                    "param": None,
                    "line": None,
                }
            )
        return {"errors": json.dumps(errors)} if errors else {}


def _retry_after_s(exc: OpenAIError) -> float | None:
    """How long to wait before the request may pass, if it may (a rate limit with
    a retry-after, a busy model); None when retrying cannot help."""
    if exc.status == 503:
        return float(exc.headers.get("retry-after", 1))
    if exc.status == 429 and "retry-after-ms" in exc.headers:
        return int(exc.headers["retry-after-ms"]) / 1000
    return None


STORAGE_BOUND = "storage_limit_exceeded"  # a batch's results reached its key's file storage bound
# The error-file line of a request a batch never ran, by why.
_NOT_RUN = {
    "batch_cancelled": "The batch was cancelled before this request ran.",
    "batch_expired": "The batch was expired before this request ran.",
    "api_key_revoked": "The batch's API key was revoked or disabled before this request ran.",
}


def _ended(running: set[asyncio.Task], slots: asyncio.Semaphore, task: asyncio.Task) -> None:
    """A batch request's task is done: it leaves the running set and frees its slot."""
    running.discard(task)
    slots.release()
