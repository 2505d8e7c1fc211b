"""Coalescing a token stream into fewer, larger items for the hop to the ingress.

Every item a Serve replica yields costs an object transfer and a wake-up at
the ingress and the proxy; on a small CPU box that cost competes with the
engine. vLLM yields one SSE event per engine step per request, so under load
events pile up faster than they can be shipped. Here a pump task drains the
source into a queue while the previous item is in flight, and each item sent
joins everything that has arrived since: no delay when the consumer keeps up
(the first token is never held back), fewer hops when it does not.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

_END = object()

# The operations whose vLLM request takes ``stream_interval``.
TOKEN_BATCHED = frozenset({"chat", "completions"})


def batch_tokens(operation: str, body: dict[str, Any], tokens: int, others: bool) -> dict[str, Any]:
    """``body``, asking vLLM to send ``tokens`` tokens per chunk when ``others``
    (other streams on this replica): fewer chunks to build and relay, before any
    coalescing. A client's own larger ``stream_interval`` stands; one that is not
    a whole number is left for vLLM to refuse (a 400), as it would be alone."""
    if tokens <= 1 or not others or operation not in TOKEN_BATCHED:
        return body
    asked = body.get("stream_interval")
    if asked is None or (type(asked) is int and 1 <= asked < tokens):
        return {**body, "stream_interval": tokens}
    return body


async def coalesce(
    source: AsyncIterator[str], interval_s: float = 0.0, busy: Callable[[], bool] | None = None
) -> AsyncIterator[str]:
    """Yield ``source``'s strings, joining those that arrive while the last was sent.

    ``interval_s`` > 0 additionally waits that long after each item (except the
    first) so more events join it: fewer, larger items at the cost of latency
    between tokens. The wait ends early when the source does, so a stream's end
    is never held back. With ``busy``, it waits only while ``busy()`` says other
    streams compete for the CPU: a lone stream's items go out as they come.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump():
        try:
            async for item in source:
                queue.put_nowait(item)
        except BaseException as exc:  # re-raised in the consumer
            queue.put_nowait(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            queue.put_nowait(_END)

    task = asyncio.create_task(pump())
    first = True
    try:
        while True:
            item = await queue.get()
            if not first and interval_s > 0 and item is not _END and (busy is None or busy()):
                # Wait for more to join, but not past the source's end: the last
                # tokens, the usage and [DONE] go out as soon as they exist.
                await asyncio.wait((task,), timeout=interval_s)
            first = False
            parts: list[str] = []
            while True:
                if item is _END:
                    if parts:
                        yield "".join(parts)
                    return
                if isinstance(item, BaseException):
                    if parts:
                        yield "".join(parts)
                    raise item
                parts.append(item)
                if queue.empty():
                    break
                item = queue.get_nowait()
            yield "".join(parts)
    finally:
        # Client gone or stream over: cancelling the pump cancels vLLM's
        # generator, which aborts the request in the engine.
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()
