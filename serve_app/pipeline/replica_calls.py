"""Calls to a model's replicas through Serve, as the gateway makes them: handed to a
replica within a bound (``reach_replica``), and a unary call's one answer read from
the stream it travels as (``only_item``)."""

from __future__ import annotations

import asyncio

from serve_app.ray_private import unary_assigned


class QueueTimeout(Exception):
    """No replica took the request within the model's ``queue_timeout_s``."""


async def reach_replica(send, timeout_s: float, before=None):
    """``send()`` a call (unary or streaming) and wait until Serve has handed it to
    a replica: immediate when one has room, longer while all are busy or the model
    is scaling up from zero. ``before()``, when given, is awaited first within the
    same bound (the fair-share queue). Past ``timeout_s`` the call is withdrawn and
    ``QueueTimeout`` raised; else the call is returned. Serve has no public hook for
    "assigned"; its responses await this private coroutine first (pinned by the
    scale-to-zero end-to-end test)."""
    response = None
    try:
        async with asyncio.timeout(timeout_s):  # no extra task per request, unlike wait_for
            if before is not None:
                await before()
            response = send()
            await unary_assigned(response)
    except TimeoutError:
        if response is not None:
            response.cancel()
        raise QueueTimeout from None
    return response


async def only_item(response):
    """The one item of a unary call's stream, read to its end (Serve counts the call
    done only then)."""
    items = [item async for item in response]
    if len(items) != 1:
        raise RuntimeError(f"a unary call answered {len(items)} items")
    return items[0]
