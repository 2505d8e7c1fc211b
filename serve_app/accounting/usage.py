"""Reading what admission and settlement wrote: request records and usage.

Request ids carry their key id (``<key_id>-<random>``), so a record can be
found from the id alone, under the key's hash tag. Completion ids are
``chatcmpl-<request id>`` (vLLM's prefix); both forms are accepted, and so is
the response's ``x-request-id`` (Ray Serve's id, indexed at admission).
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import re
import secrets
import time
from typing import Any

from serve_app.redis_store import redis_names

_COMPLETION_PREFIXES = ("chatcmpl-", "cmpl-")
# ``<key id>-<8 hex: the second it was made><16 hex random>``; ids made before they
# carried their time are 16 random hex digits.
_OUR_ID = re.compile(r"^k[0-9a-z]+-(?:[0-9a-f]{8})?[0-9a-f]{16}$")
_INT_FIELDS = {
    "received_ms",
    "first_token_ms",
    "finished_ms",
    "reserved_tokens",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
}


def new_request_id(key_id: str) -> str:
    """A request id: its key's id (its record's hash tag), the second it was made
    (where the record sink files it: record_sink.py) and 64 random bits."""
    return f"{key_id}-{int(time.time()):08x}{secrets.token_hex(8)}"


# The edge's id of a request (contract.edge.EDGE_REQUEST_HEADER): a UUID.
_EDGE_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def edge_request_tag(edge_id: str | None, edge_us: str | None) -> str:
    """What follows the key's id in the request id of a request the edge named
    (``edge_id``, stamped at ``edge_us``, both headers HAProxy sets on every request and
    sends unchanged with each try of it): the same for every try, so that a try the
    edge sends again after its replica died takes over the first's admission (admit.lua)
    instead of being charged again. '' for a request without a well-formed one."""
    if not edge_id or not _EDGE_UUID.fullmatch(edge_id):
        return ""
    seconds = int(edge_us) // 1_000_000 if edge_us and edge_us.isdigit() and len(edge_us) <= 20 else int(time.time())
    return f"{seconds:08x}{hashlib.blake2b(edge_id.lower().encode(), digest_size=8).hexdigest()}"


def edge_attempt_tag(tag: str, attempt: int) -> str:
    """The tag of a request's ``attempt``-th admission (0: its first, ``tag`` itself; one
    more for each prompt resize or fallback), made the same by every try the edge sends
    of it: filed under the same second, told apart by a hash."""
    if attempt == 0:
        return tag
    return tag[:8] + hashlib.blake2b(f"{tag}/{attempt}".encode(), digest_size=8).hexdigest()


def id_time(request_id: str) -> int | None:
    """When ``request_id`` was made, in ms (None: an id without its time)."""
    _, _, tail = request_id.rpartition("-")
    if len(tail) != 24:
        return None
    try:
        return int(tail[:8], 16) * 1000
    except ValueError:
        return None


def key_id_of(request_id: str) -> tuple[str, str]:
    """(key id, bare request id) of a request or completion id."""
    for prefix in _COMPLETION_PREFIXES:
        if request_id.startswith(prefix):
            request_id = request_id[len(prefix) :]
    key_id, sep, _ = request_id.partition("-")
    if not sep:
        raise ValueError(f"not a request id: {request_id!r}")
    return key_id, request_id


def is_own_key(account_id: str, request_id: str) -> bool:
    """Whether ``account_id`` is the key that made the request (a request is also
    admitted and settled at its key's team, under the same id)."""
    return key_id_of(request_id)[0] == account_id


async def request_state(redis, request_id: str, key_id: str | None = None, sink=None) -> dict[str, Any] | None:
    """The record of a request, by completion id, request id or x-request-id; an
    x-request-id is looked up among ``key_id``'s requests when given (a client may
    reuse another's id), else it names the first request that used it. Redis
    first (requests in flight, the recent ones), then ``sink`` (a ``RecordSink``:
    final records for the whole retention), read off the event loop."""
    bare = request_id
    for prefix in _COMPLETION_PREFIXES:
        bare = bare.removeprefix(prefix)
    if not _OUR_ID.match(bare):
        indexed = await redis.get(redis_names.http_request(request_id, key_id))
        if indexed is None:
            if sink is None:
                return None
            return await asyncio.to_thread(sink.find, http_request_id=request_id, key_id=key_id)
        bare = _text(indexed)
    owner, bare = key_id_of(bare)
    if key_id is not None and owner != key_id:
        return None
    raw = await redis.hgetall(redis_names.request_record(owner, bare))
    if raw:
        return as_state(bare, raw)
    if sink is None:
        return None
    return await asyncio.to_thread(sink.find, bare)


def as_state(request_id: str, raw: dict) -> dict[str, Any]:
    """A request record as Redis holds it (a hash of strings) → its id first, then
    its fields, counts as numbers: what ``requests show`` prints and the sink keeps."""
    state: dict[str, Any] = {"id": request_id}
    for name, value in raw.items():
        name, value = _text(name), _text(value)
        state[name] = int(value) if name in _INT_FIELDS else value
    return state


async def key_usage(redis, key_id: str, now: datetime.datetime | None = None) -> dict[str, Any]:
    """Today's and this month's (UTC) counters of one key, and its refusals
    (today's count; the last hour's by limit kind)."""
    now = now or datetime.datetime.now(datetime.UTC)
    raw = {_text(k): int(v) for k, v in (await redis.hgetall(redis_names.usage(key_id))).items()}
    periods = {"today": now.strftime("d:%Y%m%d"), "month": now.strftime("m:%Y%m")}
    counters = ("requests", "tokens", "prompt_tokens", "completion_tokens", "cost_nanos")
    usage: dict[str, Any] = {
        label: {counter: raw.get(f"{period}:{counter}", 0) for counter in counters} for label, period in periods.items()
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
