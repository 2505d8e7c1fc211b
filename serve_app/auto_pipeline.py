"""Script calls made in the same event-loop turn go to Redis as one pipeline.

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
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError

from serve_app.redis_client import clear_error

# Calls in one pipeline at most: a huge pipeline would hold one connection (and
# Redis' event loop) for long and make its first caller wait for its last.
MAX_PIPELINE = 512


class AutoPipeline:
    def __init__(self, redis, max_pipeline: int = MAX_PIPELINE):
        self.redis = redis
        self.max_pipeline = max_pipeline
        self._pending: list[tuple[AsyncScript, Sequence, Sequence, asyncio.Future]] = []
        self._tasks: set[asyncio.Task] = set()
        # Figures for tests and the benchmark: pipelines sent, calls sent.
        self.pipelines = 0
        self.calls = 0

    def call(self, script: AsyncScript, keys: Sequence, args: Sequence) -> asyncio.Future:
        """The reply of ``script(keys=keys, args=args)``, sent with the other calls
        of this turn. Cancelling the future does not take the call back."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._pending:
            loop.call_soon(self._send_pending)
        self._pending.append((script, keys, args, future))
        return future

    def _send_pending(self) -> None:
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), self.max_pipeline):
            task = asyncio.get_running_loop().create_task(self._send(pending[start:start + self.max_pipeline]))
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
        if len(calls) == 1:  # nothing to gain from a pipeline
            script, keys, args = calls[0][:3]
            try:
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
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for script, keys, args, *_ in calls:
                    # Not pipe.evalsha: a cluster pipeline blocks that method by name
                    # (an old concern over finding its slot), yet routes the command
                    # by its keys like any other.
                    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
                replies = await pipe.execute(raise_on_error=False)
        except BaseException as exc:
            cleared = clear_error(exc)
            if cleared is exc:
                raise
            raise cleared from exc
        return [clear_error(reply) if isinstance(reply, BaseException) else reply for reply in replies]

