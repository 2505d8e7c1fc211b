"""What a key left in Redis once its requests are over: request records and
concurrency leases. Settlement runs off the response path (a background task
of the ingress), so a client can read its answer before Redis has been told:
tests wait for it, within a bound, instead of reading once."""

from __future__ import annotations

import time

from serve_app.redis_store import redis_names


def records(redis, key_id: str) -> list[dict[str, str]]:
    """Every request record of ``key_id`` (a synchronous redis client)."""
    found = []
    for name in redis.scan_iter(match=redis_names.request_record_prefix(key_id) + "*", count=1000):
        found.append({k.decode(): v.decode() for k, v in redis.hgetall(name).items()})
    return found


def inference(found: list[dict[str, str]]) -> list[dict[str, str]]:
    """The records of requests that named a model (not the key's Files, Batch or
    stored-response calls, which are admitted too, with no model)."""
    return [record for record in found if record.get("model")]


def wait_until_settled(redis, key_id: str, timeout_s: float = 15, records_expected: int = 0) -> list[dict[str, str]]:
    """Every record final and no lease left; returns the records. With
    ``records_expected``, also wait until that many exist: a request admitted
    on local limits during an outage has no record until the ingress replays
    its settlement (once a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = records(redis, key_id)
        open_ = [r for r in found if r["status"] in ("admitted", "running")]
        leases = redis.zcard(redis_names.concurrency(key_id))
        if not open_ and not leases and len(found) >= records_expected:
            return found
        assert time.monotonic() < deadline, (open_, leases, len(found), records_expected)
        time.sleep(0.1)


def assert_within_reservations(found: list[dict[str, str]]) -> None:
    """Every finished record of ``found`` was charged at most what its admission reserved
    (docs/quotas.md, "The reservation bounds every prompt"): its prompt's tokens, and its
    prompt's and completion's together. A record without usage was charged its reservation."""
    # A record without a reservation is a request admitted on the ingress' local limits
    # while Redis did not answer (settle.lua writes it): bounded by those, not by a reservation.
    finished = [r for r in found if r["status"] not in ("admitted", "running") and "reserved_tokens" in r]
    assert finished, f"no finished request record with a reservation among {len(found)}"
    for record in finished:
        reserved = int(record["reserved_tokens"])
        if record.get("usage") == "reserved":
            assert int(record["total_tokens"]) == reserved, record
            continue
        assert int(record["prompt_tokens"]) <= reserved, record
        assert int(record["prompt_tokens"]) + int(record["completion_tokens"]) <= reserved, record


def counters(redis, account_id: str) -> dict[str, int]:
    """What a key or team was charged today, from its usage hash (requests, tokens,
    cost_nanos, refused, ...)."""
    prefix = time.strftime("d:%Y%m%d", time.gmtime()) + ":"
    return {
        name.decode()[len(prefix) :]: int(value)
        for name, value in redis.hgetall(redis_names.usage(account_id)).items()
        if name.decode().startswith(prefix) and name.decode().count(":") == 2
    }
