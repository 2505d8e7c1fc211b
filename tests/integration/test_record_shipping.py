"""Final request records leave Redis for the record sink (serve_app/accounting/record_shipper.py)
against a real Redis (one node, a cluster, Sentinel), through the real admission and
settlement scripts: every settled record reaches the sink once, Redis keeps it only
``records.recent_s``, a lookup finds it after Redis forgot it, a sink that is down
loses nothing and stops admissions at the backlog bound, and a shipper that died
with records read leaves them to another."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from small_disk import fill, small_disk

from contract.replica_wire import Usage
from serve_app.accounting import record_shipper
from serve_app.accounting.record_shipper import RecordShipper
from serve_app.accounting.usage import request_state
from serve_app.admin import operations as admin
from serve_app.errors import OpenAIError
from serve_app.http.services import QuotaServices, build_quota_services
from serve_app.identity.keys import KeyStore
from serve_app.redis_store import redis_names
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry

RECENT_S = 120


def access_for(redis_url: str, sink_dir, max_backlog: int = 1000) -> QuotaServices:
    settings = AppSettings(
        redis_url=redis_url, records={"sink_dir": str(sink_dir), "recent_s": RECENT_S, "max_backlog": max_backlog}
    )
    return build_quota_services(settings, Telemetry(False, False))


async def settled_requests(access: QuotaServices, key, count: int) -> list[str]:
    """``count`` requests admitted and settled, as the gateway does (settlement runs off the request path)."""
    ids = []
    for i in range(count):
        ticket = await access.gate.admit(key, "chat", 20, http_request_id=f"client-{key.id}-{i}")
        access.gate.settle(ticket, "completed")
        ids.append(ticket.request_id)
    while access.gate._background:
        await asyncio.sleep(0.01)
    return ids


async def drain(shipper: RecordShipper) -> None:
    while await shipper.ship_once():
        pass


def sink_lines(sink_dir) -> list[dict]:
    return [json.loads(line) for path in sorted(sink_dir.rglob("*.jsonl")) for line in path.read_text().splitlines()]


async def test_settled_records_reach_the_sink_once_and_stay_in_redis_only_a_recent_while(redis, redis_url, tmp_path):
    access = access_for(redis_url, tmp_path)
    key, _ = await KeyStore(redis).create("shipped")
    ids = await settled_requests(access, key, 30)
    assert await redis.xlen(redis_names.RECORD_OUTBOX) == 30
    await drain(access.stores.records)
    lines = sink_lines(tmp_path)
    assert sorted(line["id"] for line in lines) == sorted(ids) and access.stores.records.backlog == 0
    for request_id in ids:  # the sink holds what Redis holds, and Redis holds it a recent while only
        name = redis_names.request_record(key.id, request_id)
        assert 0 < await redis.ttl(name) <= RECENT_S
        assert await request_state(redis, request_id) == next(line for line in lines if line["id"] == request_id)
    assert 0 < await redis.ttl(redis_names.http_request(f"client-{key.id}-3")) <= RECENT_S
    # Past Redis' window, the sink answers, by request id and by x-request-id.
    await redis.delete(
        redis_names.request_record(key.id, ids[3]),
        redis_names.http_request(f"client-{key.id}-3"),
        redis_names.http_request(f"client-{key.id}-3", key.id),
    )
    assert await request_state(redis, ids[3]) is None
    found = await request_state(redis, ids[3], sink=access.stores.records.sink)
    assert found["id"] == ids[3] and found["status"] == "completed" and found["key_id"] == key.id
    by_client_id = await request_state(redis, f"client-{key.id}-3", sink=access.stores.records.sink)
    assert by_client_id["id"] == ids[3]
    await access.redis.aclose()


async def test_a_teams_copy_of_a_record_is_not_shipped_twice(redis, redis_url, tmp_path):
    access = access_for(redis_url, tmp_path)
    team = await admin.create_team(access.stores, {"name": "shipping-team"}, "admin:test")
    created = await admin.create_key(access.stores, {"name": "team-member", "team": "shipping-team"}, "admin:test")
    key = await access.stores.keys.get(created["id"])
    [request_id] = await settled_requests(access, key, 1)
    await drain(access.stores.records)
    assert [line["id"] for line in sink_lines(tmp_path)] == [request_id]
    assert 0 < await redis.ttl(redis_names.request_record(team["id"], request_id)) <= RECENT_S
    await access.redis.aclose()


async def test_a_sink_that_is_down_loses_nothing_and_stops_admissions_at_the_backlog_bound(redis, redis_url, tmp_path):
    down = tmp_path / "sink"
    down.write_text("a file where the directory should be")  # every append fails
    access = access_for(redis_url, down, max_backlog=10)
    key, _ = await KeyStore(redis).create("backlogged")
    ids = await settled_requests(access, key, 10)
    with pytest.raises(OSError):
        await access.stores.records.ship_once()
    access.stores.records.backlog = await redis.xlen(redis_names.RECORD_OUTBOX)
    assert access.stores.records.backlog == 10 and access.stores.records.backlogged
    with pytest.raises(OpenAIError) as refused:
        await access.gate.admit(key, "chat", 20)
    assert refused.value.status == 503 and refused.value.code == "records_backlog"
    assert "retry-after" in refused.value.headers
    down.unlink()  # the share is back
    await drain(access.stores.records)
    assert sorted(line["id"] for line in sink_lines(down)) == sorted(ids)  # each once, none lost
    assert not access.stores.records.backlogged
    ids += await settled_requests(access, key, 1)  # admitted again
    await drain(access.stores.records)
    assert len(sink_lines(down)) == 11
    await access.redis.aclose()


async def test_records_a_shipper_read_and_never_wrote_are_claimed_by_another(redis, redis_url, tmp_path, monkeypatch):
    access = access_for(redis_url, tmp_path)
    key, _ = await KeyStore(redis).create("claimed")
    ids = await settled_requests(access, key, 5)
    dead = RecordShipper(redis, access.stores.records.sink, 1000, writer="dead")
    await dead._ensure_group()
    assert len(await dead._read(">")) == 5  # read, then its process died
    monkeypatch.setattr(record_shipper, "CLAIM_IDLE_MS", 0)
    await drain(access.stores.records)
    assert sorted(line["id"] for line in sink_lines(tmp_path)) == sorted(ids)
    assert await redis.xlen(redis_names.RECORD_OUTBOX) == 0
    await access.redis.aclose()


def two_ingresses(redis_url: str, tmp_path, lease_s: float = 0.5) -> tuple[QuotaServices, QuotaServices]:
    """Two ingress replicas' quota services sharing Redis and a sink, with a 0.5 s lease."""
    settings = AppSettings(
        redis_url=redis_url,
        quota={"concurrency_lease_s": lease_s},
        records={"sink_dir": str(tmp_path), "recent_s": RECENT_S},
    )
    first, second = (build_quota_services(settings, Telemetry(False, False)) for _ in range(2))
    return first, second


async def test_a_request_whose_ingress_died_is_finalised_by_another_and_reaches_the_sink(redis, redis_url, tmp_path):
    """One ingress admits and dies (never settles, never renews); another one's
    maintenance reaps the lease once it expired, and ships the abandoned record: the
    sink holds one final record per admitted request even when no ingress settles it."""
    dying, survivor = two_ingresses(redis_url, tmp_path)
    key, _ = await KeyStore(redis).create("left-behind")
    ticket = await dying.gate.admit(key, "chat", 20, http_request_id="client-left-behind")
    await dying.redis.aclose()  # it dies: no settlement, no renewal
    assert await survivor.gate.reap_abandoned() == 0  # its lease has not expired yet
    await asyncio.sleep(0.9)  # lease (0.5 s) and a half: the registration is due
    assert await survivor.gate.reap_abandoned() == 1
    await drain(survivor.stores.records)
    [line] = [line for line in sink_lines(tmp_path) if line["id"] == ticket.request_id]
    assert line["status"] == "abandoned" and line["http_request_id"] == "client-left-behind"
    assert line["total_tokens"] == 20 and line["usage"] == "reserved"
    assert await survivor.gate.reap_abandoned() == 0  # once
    assert await redis.zcard(redis_names.LEASES_DUE) == 0
    await survivor.redis.aclose()


async def test_a_dead_ingress_request_is_finalised_though_a_live_one_keeps_its_key_busy(redis, redis_url, tmp_path):
    """The soak's 30-minute run left three requests open 15 minutes after their ingress
    was killed: their keys and teams went on being admitted by the live ingresses,
    and each registration put the account's due time off. A registration may only
    bring it forward: the dead request is final within a lease and a half of its
    admission while its key never pauses."""
    dying, busy = two_ingresses(redis_url, tmp_path)
    key, _ = await KeyStore(redis).create("kept-busy")
    dead = await dying.gate.admit(key, "chat", 20)
    await dying.redis.aclose()  # it dies: no settlement, no renewal
    record = redis_names.request_record(key.id, dead.request_id)
    began = time.monotonic()
    while await redis.hget(record, "status") != b"abandoned":
        assert time.monotonic() - began < 3.0, "the dead ingress' request was never reaped"
        ticket = await busy.gate.admit(key, "chat", 5)  # registers the key every half lease
        busy.gate.settle(ticket, "completed", Usage(prompt_tokens=1, completion_tokens=1))
        await busy.gate.reap_abandoned()
        await asyncio.sleep(0.05)
    assert time.monotonic() - began < 0.5 * 1.5 + 1.0  # a lease and a half, and a tick
    while busy.gate._unsettled:
        await busy.gate.flush_unsettled()
    await busy.redis.aclose()


async def test_a_request_whose_settlement_waits_for_redis_keeps_its_lease_and_its_real_charge(
    redis, redis_url, tmp_path, monkeypatch
):
    """The soak: a replica whose Redis calls failed for minutes queued its requests'
    settlements; their leases were no longer renewed, so the reaper finalised them
    `abandoned` (the reservation) a lease later, and the real settlement found them
    final. A queued settlement's lease is renewed until it lands.

    A 2 s lease, renewed and reaped back to back every 0.2 s: a busy CI box once
    stalled this loop past a 0.5 s lease before its first renewal (the lane beside
    the unit tests), which reaped the request for a reason that is not the bug."""
    ingress, reaper = two_ingresses(redis_url, tmp_path, lease_s=2.0)
    key, _ = await KeyStore(redis).create("settles-late")
    ticket = await ingress.gate.admit(key, "chat", 50)
    real_settle_many = ingress.gate.admission.settle_many

    async def refused(*args, **kwargs):
        raise RedisConnectionError("Redis did not take it")

    monkeypatch.setattr(ingress.gate.admission, "settle", refused, raising=False)
    monkeypatch.setattr(ingress.gate.admission, "settle_many", refused)
    ingress.gate.settle(ticket, "completed", Usage(prompt_tokens=7, completion_tokens=3))
    await ingress.gate.renew_leases()
    for _ in range(30):  # three leases: renewed all along, never reaped
        await asyncio.sleep(0.2)
        await ingress.gate.flush_unsettled()
        await ingress.gate.renew_leases()
        await reaper.gate.reap_abandoned()
    record = redis_names.request_record(key.id, ticket.request_id)
    assert await redis.hget(record, "status") in (b"admitted", b"running")
    monkeypatch.setattr(ingress.gate.admission, "settle_many", real_settle_many)
    while ingress.gate._unsettled:
        await ingress.gate.flush_unsettled()
    assert await redis.hget(record, "status") == b"completed"
    assert await redis.hget(record, "total_tokens") == b"10"
    await ingress.redis.aclose()
    await reaper.redis.aclose()


async def test_a_sink_on_a_full_disk_refuses_new_work_with_a_503_and_writes_each_record_once(
    redis, redis_url, tmp_path
):
    """The record sink's disk fills (a 64 KiB tmpfs, as a sink sharing a full disk): what
    could not be written stays in the outbox, no part of a batch is left in a file, new
    requests get 503 records_backlog at the bound, and once the disk has room every
    record is written exactly once (charges live in Redis' counters: none twice)."""
    with small_disk(tmp_path / "sink", "64k") as sink:
        filler = fill(sink, leave_bytes=4096)  # room for a few records, not for the batch
        access = access_for(redis_url, sink, max_backlog=40)
        key, _ = await KeyStore(redis).create("sink-full-disk")
        ids = await settled_requests(access, key, 40)
        with pytest.raises(OSError):
            await access.stores.records.ship_once()
        assert sink_lines(sink) == []  # the part that fit was taken back
        access.stores.records.backlog = await redis.xlen(redis_names.RECORD_OUTBOX)
        with pytest.raises(OpenAIError) as refused:
            await access.gate.admit(key, "chat", 20)
        assert refused.value.status == 503 and refused.value.code == "records_backlog"
        filler.unlink()
        await drain(access.stores.records)
        assert sorted(line["id"] for line in sink_lines(sink)) == sorted(ids)  # each once
        assert all(path.read_bytes().endswith(b"\n") for path in sink.rglob("*.jsonl"))
        await access.redis.aclose()
