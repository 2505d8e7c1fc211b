"""Reading what admission and settlement wrote: request records and usage.

Request ids carry their key id (``<key_id>-<random>``), so a record can be
found from the id alone, under the key's hash tag. Completion ids are
``chatcmpl-<request id>`` (vLLM's prefix); both forms are accepted, and so is
the response's ``x-request-id`` (Ray Serve's id, indexed at admission).
"""

from __future__ import annotations

import datetime
import re
import secrets
from typing import Any

from serve_app.quota import redis_names

_COMPLETION_PREFIXES = ("chatcmpl-", "cmpl-")
_OUR_ID = re.compile(r"^k[0-9a-z]+-[0-9a-f]{16}$")
_INT_FIELDS = {
    "received_ms", "first_token_ms", "finished_ms", "reserved_tokens",
    "prompt_tokens", "completion_tokens", "total_tokens",
}


def new_request_id(key_id: str) -> str:
    return f"{key_id}-{secrets.token_hex(8)}"


def key_id_of(request_id: str) -> tuple[str, str]:
    """(key id, bare request id) of a request or completion id."""
    for prefix in _COMPLETION_PREFIXES:
        if request_id.startswith(prefix):
            request_id = request_id[len(prefix):]
    key_id, sep, _ = request_id.partition("-")
    if not sep:
        raise ValueError(f"not a request id: {request_id!r}")
    return key_id, request_id


async def request_state(redis, request_id: str, key_id: str | None = None) -> dict[str, Any] | None:
    """The record of a request, by completion id, request id or x-request-id; an
    x-request-id is looked up among ``key_id``'s requests when given (a client may
    reuse another's id), else it names the first request that used it."""
    bare = request_id
    for prefix in _COMPLETION_PREFIXES:
        bare = bare.removeprefix(prefix)
    if not _OUR_ID.match(bare):
        indexed = await redis.get(redis_names.http_request(request_id, key_id))
        if indexed is None:
            return None
        bare = _text(indexed)
    owner, bare = key_id_of(bare)
    if key_id is not None and owner != key_id:
        return None
    key_id = owner
    raw = await redis.hgetall(redis_names.request_record(key_id, bare))
    if not raw:
        return None
    state: dict[str, Any] = {"id": bare}
    for name, value in raw.items():
        name, value = _text(name), _text(value)
        state[name] = int(value) if name in _INT_FIELDS else value
    return state


async def key_usage(redis, key_id: str, now: datetime.datetime | None = None) -> dict[str, Any]:
    """Today's and this month's (UTC) counters of one key, and its refusals
    (today's count; the last hour's by limit kind)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    raw = {_text(k): int(v) for k, v in (await redis.hgetall(redis_names.usage(key_id))).items()}
    periods = {"today": now.strftime("d:%Y%m%d"), "month": now.strftime("m:%Y%m")}
    counters = ("requests", "tokens", "prompt_tokens", "completion_tokens", "cost_nanos")
    usage: dict[str, Any] = {
        label: {counter: raw.get(f"{period}:{counter}", 0) for counter in counters}
        for label, period in periods.items()
    }
    usage["today"]["refused"] = raw.get(f"{periods['today']}:refused", 0)
    # Refusals of the last hour by kind (admit.lua keeps them per minute).
    minute = int(now.timestamp()) // 60
    recent: dict[str, int] = {}
    for field, count in (await redis.hgetall(redis_names.refusals(key_id))).items():
        at, _, kind = _text(field).partition(":")
        if int(at) > minute - 60:
            recent[kind] = recent.get(kind, 0) + int(count)
    usage["refused_last_hour"] = recent
    return usage


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
