"""One page of a key's objects (files, batches) from the sorted set indexing them.

A listing reads the index a page at a time (by rank, from the ``after`` cursor)
and the page's records in one round trip, so what a page costs is bounded by
the page, not by how many objects the key holds. Index entries whose record
expired are dropped from the index as they are met.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from serve_app.redis_store.redis_client import as_text

# Index entries read per round trip beyond the page (a filter may skip some).
_READ_AHEAD = 1


async def index_page(
    redis,
    index: str,
    load: Callable[[list[str]], Awaitable[list[Any | None]]],
    limit: int,
    desc: bool = True,
    after: str | None = None,
    keep: Callable[[Any], bool] = lambda record: True,
) -> tuple[list[Any], bool]:
    """(up to ``limit`` records, whether more follow) after ``after`` in ``index``'s
    order (highest score first when ``desc``). ``load(ids)`` gives each id's
    record or None when it is gone; ``keep`` filters records (a purpose)."""
    start = 0
    if after is not None:
        rank = await (redis.zrevrank(index, after) if desc else redis.zrank(index, after))
        if rank is None:
            return [], False
        start = rank + 1
    found: list[Any] = []
    step = limit + _READ_AHEAD
    while len(found) <= limit:
        ids = [as_text(i) for i in await redis.zrange(index, start, start + step - 1, desc=desc)]
        if not ids:
            break
        records = await load(ids)
        gone = [object_id for object_id, record in zip(ids, records) if record is None]
        if gone:
            await redis.zrem(index, *gone)
        start += len(ids) - len(gone)  # the ones removed no longer take a rank
        found += [record for record in records if record is not None and keep(record)]
    return found[:limit], len(found) > limit
