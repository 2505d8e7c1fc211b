"""Script calls (and commands) made in the same event-loop turn go to Redis as one pipeline.

An ingress admits and settles many requests at once; sent one by one, each
script call pays redis-py's whole per-command path (a pool checkout, a write, a
read, a wake-up) and Redis a read and a write syscall. Calls that arrive while
the loop is busy are sent together on the next turn instead, as ioredis'
auto-pipelining does: under load the cost per call falls several times, alone a
call waits for nothing (it goes out on the next turn, as one call).

Each call keeps its own reply or error: a pipeline is not a transaction, and a
script that fails does not touch the others. A connection or timeout error
fails every call of that pipeline, as it would have failed each of them alone
(the callers' fail_mode applies; their writes may have run, and settling is
idempotent). A cluster client sends one pipeline per node (redis-py's
ClusterPipeline groups the calls by slot and follows MOVED/ASK per call).
Scripts are called by SHA; a node that lacks one (a restart, a promoted
replica) answers NOSCRIPT and those calls alone are sent again after it is loaded.
A call on a cluster that lost its connection or timed out has the client learn
the slot map again (once at a time, at most once a second): redis-py does so
when a lone command fails, but not when a pipelined call's reply never comes,
nor when a pipeline fails to connect and may not retry (this client tries
once), so a client that only pipelines would send to a dead primary's address
for as long as something answers there (a proxy, a restarted node: 3 minutes in
the soak), or for as long as the address refuses (a failover's queued
settlements, 20 s and more in a CI run).

With ``replicas_to_acknowledge`` (quota settings), each pipeline ends in
``WAIT replicas timeout`` on the connection that sent it (one per node on a
cluster): a call counts as done only once that many replicas have its writes,
so a failover cannot lose it. Calls WAIT does not vouch for in time (a replica
down or slow; a call a cluster redirected to another node meanwhile) fail as
``NotReplicated``, which the gateway treats as Redis unreachable (fail_mode);
their request ids are settled later, which undoes what they wrote.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from serve_app.redis_store.redis_client import clear_error

# Calls in one pipeline at most: a huge pipeline would hold one connection (and
# Redis' event loop) for long and make its first caller wait for its last.
MAX_PIPELINE = 512
# A cluster's slot map is learned again at most this often after failed calls: one
# CLUSTER SLOTS, while a failover may take seconds to show in the map.
RELEARN_EVERY_S = 1.0

logger = logging.getLogger(__name__)


class NotReplicated(RedisConnectionError):
    """Redis ran the call, but fewer replicas than asked acknowledged it in time:
    a failover could still lose it, so it counts as Redis unreachable."""


class AutoPipeline:
    def __init__(
        self,
        redis,
        max_pipeline: int = MAX_PIPELINE,
        replicas_to_acknowledge: int = 0,
        acknowledge_timeout_ms: int = 100,
    ):
        self.redis = redis
        self.max_pipeline = max_pipeline
        self.replicas_to_acknowledge = replicas_to_acknowledge
        self.acknowledge_timeout_ms = acknowledge_timeout_ms
        # (script, its keys, its args, the caller's future); a command: (None, (its key,), the command)
        self._pending: list[tuple[AsyncScript | None, Sequence, Sequence, asyncio.Future]] = []
        self._tasks: set[asyncio.Task] = set()
        # Figures for tests and the benchmark: pipelines sent, calls sent.
        self.pipelines = 0
        self.calls = 0
        self._relearned_at = float("-inf")
        self._relearning: asyncio.Task | None = None

    def call(self, script: AsyncScript, keys: Sequence, args: Sequence) -> asyncio.Future:
        """The reply of ``script(keys=keys, args=args)``, sent with the other calls
        of this turn. Cancelling the future does not take the call back."""
        return self._queue(script, keys, args)

    def command(self, *args) -> asyncio.Future:
        """The reply of the Redis command ``args`` (its key second, as a cluster routes
        it: ``SET key ...``), sent with the other calls of this turn: a request's
        bookkeeping beside its admissions and settlements, not a write of its own."""
        return self._queue(None, args[1:2], args)

    def _queue(self, script: AsyncScript | None, keys: Sequence, args: Sequence) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._pending:
            loop.call_soon(self._send_pending)
        self._pending.append((script, keys, args, future))
        return future

    def _send_pending(self) -> None:
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), self.max_pipeline):
            task = asyncio.get_running_loop().create_task(self._send(pending[start : start + self.max_pipeline]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, calls: list) -> None:
        try:
            replies = await self.run(calls)
        except BaseException as exc:  # noqa: BLE001 - every caller gets it; a cancel too
            replies = [exc] * len(calls)
        for (_, _, _, future), reply in zip(calls, replies):
            if future.done():  # its caller gave up waiting
                continue
            if isinstance(reply, BaseException):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def run(self, calls: Sequence[tuple]) -> list:
        """Send ``(script, keys, args, ...)`` calls in one pipeline now; per call,
        its reply or its exception. Raises what fails them all (unreachable)."""
        self.pipelines += 1
        self.calls += len(calls)
        if len(calls) == 1 and not self.replicas_to_acknowledge:  # nothing to gain from a pipeline
            script, keys, args = calls[0][:3]
            try:
                if script is None:
                    return [await self.redis.execute_command(*args)]
                return [await script(keys=keys, args=args)]
            except ResponseError as exc:  # Redis answered: that call's own error
                return [exc]
        replies = await self._pipeline(calls)
        missing = [n for n, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            for script in {id(calls[n][0]): calls[n][0] for n in missing}.values():
                await self.redis.script_load(script.script)
            for n, reply in zip(missing, await self._pipeline([calls[n] for n in missing])):
                replies[n] = reply
        return replies

    async def _pipeline(self, calls: Sequence[tuple]) -> list:
        waits = self.replicas_to_acknowledge
        cluster = isinstance(self.redis, RedisCluster)
        if waits and cluster:
            await self.redis.initialize()  # the slot map (a no-op once known)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                nodes = []
                for script, keys, args, *_ in calls:
                    if script is None:  # a command: a cluster routes it by its key
                        pipe.execute_command(*args)
                    else:
                        # Not pipe.evalsha: a cluster pipeline blocks that method by name
                        # (an old concern over finding its slot), yet routes the command
                        # by its keys like any other.
                        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
                    if waits and cluster:
                        nodes.append(self.redis.get_node_from_key(keys[0]))
                # A cluster pipeline keeps each node's commands in order on one
                # connection, so a node's WAIT comes after its calls.
                targets = list({node.name: node for node in nodes}.values()) if cluster else [None]
                for node in targets if waits else []:
                    pipe.execute_command(
                        "WAIT", waits, self.acknowledge_timeout_ms, **({"target_nodes": node} if node else {})
                    )
                replies = await pipe.execute(raise_on_error=False)
        except BaseException as exc:
            cleared = clear_error(exc)
            if cluster and _lost(cleared):
                # redis-py's pipeline learns the map again after a failed connect only
                # when it may retry, and this client tries once (redis_client.py): the
                # queued settlements of a failover kept meeting the dead primary's port.
                self._relearn_slot_map()
            if cleared is exc:
                raise
            raise cleared from exc
        replies = [clear_error(reply) if isinstance(reply, BaseException) else reply for reply in replies]
        if cluster and any(_lost(reply) for reply in replies):
            self._relearn_slot_map()
        if not waits:
            return replies
        acknowledged = replies[len(calls) :]
        replies = replies[: len(calls)]
        vouched = {
            target.name if target else None
            for target, count in zip(targets, acknowledged)
            if not isinstance(count, BaseException) and count >= waits
        }
        for n, (_script, keys, *_) in enumerate(calls):
            # A call a cluster redirected ran on another node than the one WAIT asked.
            node = self.redis.get_node_from_key(keys[0]).name if cluster else None
            if not isinstance(replies[n], BaseException) and (
                node not in vouched or (cluster and node != nodes[n].name)
            ):
                replies[n] = NotReplicated(
                    f"fewer than {waits} replica(s) acknowledged the write within {self.acknowledge_timeout_ms} ms"
                )
        return replies

    def _relearn_slot_map(self) -> None:
        """Learn the cluster's slot map again, in the background: a primary whose calls
        were lost may have failed over."""
        now = time.monotonic()
        if (self._relearning is not None and not self._relearning.done()) or now - self._relearned_at < RELEARN_EVERY_S:
            return
        self._relearned_at = now
        self._relearning = asyncio.get_running_loop().create_task(self._learn_slot_map())
        self._tasks.add(self._relearning)
        self._relearning.add_done_callback(self._tasks.discard)

    async def _learn_slot_map(self) -> None:
        try:
            await self.redis.nodes_manager.initialize()
        except (RedisError, RedisClusterException) as exc:  # the next lost call tries again
            logger.debug("the cluster's slot map could not be learned again: %r", exc)


def _lost(reply) -> bool:
    """A call whose connection was lost or timed out (not one Redis answered, nor
    one it ran that replicas did not acknowledge)."""
    return isinstance(reply, (RedisConnectionError, RedisTimeoutError)) and not isinstance(reply, NotReplicated)
