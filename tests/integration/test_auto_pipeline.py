"""Script calls of one event-loop turn sent as one pipeline (serve_app/redis_store/auto_pipeline.py),
on one node, a Redis Cluster and Sentinel: each call keeps its own reply and
error, a flushed script is loaded again, an unreachable Redis fails every call
of its pipeline, and a caller that leaves mid-call leaks nothing."""

import asyncio

import pytest
from redis.asyncio import connection as redis_connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis_server import every_node
from test_admission import commandstats

from contract.replica_wire import Usage
from serve_app.admission.scripts import AdmissionScripts
from serve_app.http.services import build_quota_services
from serve_app.identity.keys import KeyRecord
from serve_app.redis_store import redis_client, redis_names
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry

_ids = iter(range(10**9))


def keys(count: int, prefix: str = "kpipe", **limits) -> list[KeyRecord]:
    return [KeyRecord(id=f"{prefix}{n}", name=f"{prefix}{n}", created_at=0, **limits) for n in range(count)]


def admit(adm: AdmissionScripts, key: KeyRecord):
    return adm.admit(key, f"{key.id}-{next(_ids):012x}", "m", 1)


async def test_calls_of_one_turn_share_one_pipeline_and_each_keeps_its_own_reply(redis):
    adm = AdmissionScripts(redis, lease_s=600, retention_s=3600)
    tenants = keys(50, requests_per_minute=3)
    await admit(adm, keys(1, prefix="kwarm")[0])  # connections open, scripts loaded
    await redis.config_resetstat(**every_node(redis))
    sent = adm.pipeline.pipelines
    decisions = await asyncio.gather(*(admit(adm, key) for key in tenants for _ in range(4)))
    # 200 calls over 50 keys (every node of a cluster), one pipeline.
    assert adm.pipeline.pipelines == sent + 1
    assert (await commandstats(redis))["cmdstat_evalsha"] == 200
    for n, key in enumerate(tenants):
        mine = decisions[4 * n : 4 * n + 4]
        assert sorted(d.admitted for d in mine) == [False, True, True, True], key.id
        assert [d.kind for d in mine if not d.admitted] == ["requests"]
        assert await redis.zcard(redis_names.concurrency(key.id)) == 3


async def test_a_call_redis_fails_fails_alone(redis):
    adm = AdmissionScripts(redis, lease_s=600, retention_s=3600)
    broken, *healthy = keys(6)
    await redis.set(redis_names.concurrency(broken.id), "not a sorted set")  # the script's ZRANGEBYSCORE fails
    replies = await asyncio.gather(*(admit(adm, key) for key in [broken, *healthy]), return_exceptions=True)
    assert isinstance(replies[0], ResponseError) and "WRONGTYPE" in str(replies[0])
    assert all(decision.admitted for decision in replies[1:])


async def test_scripts_flushed_from_redis_are_loaded_again(redis):
    adm = AdmissionScripts(redis, lease_s=600, retention_s=3600)
    tenants = keys(20, max_concurrent=5)
    await admit(adm, tenants[0])
    await redis.script_flush()  # as after a restart or a failover (a cluster: every primary)
    assert await redis.script_exists(adm._admit.sha) == [False]
    request_ids = [f"{key.id}-{next(_ids):012x}" for key in tenants]
    decisions = await asyncio.gather(*(adm.admit(key, rid, "m", 1) for key, rid in zip(tenants, request_ids)))
    assert all(decision.admitted for decision in decisions)
    await redis.script_flush()
    settled = await adm.settle_many([(key, rid, "completed", 1, 1, "", "m") for key, rid in zip(tenants, request_ids)])
    assert [done for done, _ in settled] == [True] * len(tenants)
    for key, rid in zip(tenants, request_ids):
        assert (await redis.hget(redis_names.request_record(key.id, rid), "status")) == b"completed"
    assert sum([await redis.zcard(redis_names.concurrency(key.id)) for key in tenants]) == 1  # the first one's


async def test_an_unreachable_redis_fails_every_call_of_the_pipeline(redis_server):
    nowhere = redis_server.url.rsplit(":", 1)[0] + ":1/0"  # nothing listens on port 1
    client = redis_client.connect(nowhere, timeout_s=0.5)
    adm = AdmissionScripts(client, lease_s=600, retention_s=3600)
    replies = await asyncio.gather(*(admit(adm, key) for key in keys(8)), return_exceptions=True)
    assert all(isinstance(reply, RedisConnectionError) for reply in replies), replies
    await client.aclose()


async def test_a_pipeline_has_at_most_max_pipeline_calls(redis):
    adm = AdmissionScripts(redis, lease_s=600, retention_s=3600)
    adm.pipeline.max_pipeline = 16
    await admit(adm, keys(1)[0])
    sent = adm.pipeline.pipelines
    decisions = await asyncio.gather(*(admit(adm, key) for key in keys(40)))
    assert all(decision.admitted for decision in decisions)
    assert adm.pipeline.pipelines == sent + 3  # 16 + 16 + 8


async def test_a_client_gone_during_its_admission_leaves_no_lease(redis_url, redis):
    access = build_quota_services(
        AppSettings(redis_url=redis_url, quota={"redis_timeout_s": 2}), Telemetry(False, False)
    )
    key = keys(1, max_concurrent=1)[0]
    access.gate.settle(await access.gate.admit(key, "m", 10), "completed")  # connections open
    while access.gate._background:  # the settlement is sent off the request's path
        await asyncio.sleep(0.01)
    leases = redis_names.concurrency(key.id)
    assert await redis.zcard(leases) == 0
    request = asyncio.get_running_loop().create_task(access.gate.admit(key, "m", 10))
    await asyncio.sleep(0)  # the admit call is queued for this turn's pipeline
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    for _ in range(100):  # the call still runs in Redis and takes the key's one place...
        if await redis.zcard(leases):
            break
        await asyncio.sleep(0.01)
    assert await redis.zcard(leases) == 1
    [settlement] = access.gate._unsettled.values()
    request_id, taken_back = settlement.request_id, settlement.taken_back
    assert taken_back  # a record it finds missing was never admitted there (below)
    await access.gate.flush_unsettled()  # ...and its settlement frees it
    assert await redis.zcard(leases) == 0
    # Nothing ran: a tombstone (its reservation given back, never shipped), not a request's record.
    assert await redis.hget(redis_names.request_record(key.id, request_id), "status") == b"withdrawn"
    assert (await access.gate.admit(key, "m", 10)).request_id
    await access.redis.aclose()


async def test_a_settlement_that_takes_back_an_admission_on_the_wire_marks_no_admission(redis):
    """The soak: a client left while its team's admission was on its way; the
    settlement taking it back reached Redis first and wrote the team's record as a
    local admission's (admission 'local'), though nothing was admitted there. Taken
    back, a missing record is written admission 'none'; the admit arriving after it
    changes nothing. A settlement of a request admitted without Redis still writes
    'local'."""
    adm = AdmissionScripts(redis, lease_s=600, retention_s=3600)
    key = keys(1, max_concurrent=1)[0]
    await adm.settle(key, f"{key.id}-taken-back", "cancelled", 0, 0, "", "m", taken_back=True)
    record = redis_names.request_record(key.id, f"{key.id}-taken-back")
    assert await redis.hget(record, "admission") == b"none"
    late = await adm.admit(key, f"{key.id}-taken-back", "m", 10)
    assert await redis.zcard(redis_names.concurrency(key.id)) == 0  # the late admit held nothing
    assert await redis.hget(record, "status") == b"cancelled", late
    await adm.settle(key, f"{key.id}-local", "completed", 3, 2, "", "m")
    assert await redis.hget(redis_names.request_record(key.id, f"{key.id}-local"), "admission") == b"local"


async def test_a_requests_redis_work_is_seven_calls_all_in_shared_pipelines(redis, redis_url, tmp_path, monkeypatch):
    """The hot path's shape (issue 57), so that it cannot silently regrow: 32 requests at
    once, as the gateway runs them (admitted, marked running, settled, their records
    shipped), cost Redis seven calls each (the admit, due, running and settle scripts; the
    two SETs indexing its x-request-id; its record's XADD to the outbox) and every call went
    out in an auto-pipeline shared with other requests: Redis saw no write of its own."""
    settings = AppSettings(redis_url=redis_url, records={"sink_dir": str(tmp_path)})
    gate = build_quota_services(settings, Telemetry(False, False)).gate
    pipeline = gate.admission.pipeline
    tenants = keys(32, prefix="khot", requests_per_minute=1000, tokens_per_minute=10**6, max_concurrent=4)

    async def one_request(n: int, key: KeyRecord) -> None:
        ticket = await gate.admit(key, "m", 100, http_request_id=f"hot-{n}")
        gate.running(ticket, "replica")
        await asyncio.sleep(0)  # a token or two relayed
        gate.settle(ticket, "completed", Usage(prompt_tokens=10, completion_tokens=20))

    async def settled() -> None:
        while gate._background:
            await asyncio.sleep(0.01)

    # A burst before: every script loaded, as many connections open as a burst takes.
    await asyncio.gather(*(one_request(-n, key) for n, key in enumerate(keys(32, prefix="khotwarm"), 1)))
    await settled()
    await redis.config_resetstat(**every_node(redis))
    writes = []
    sent = redis_connection.AbstractConnection.send_packed_command

    async def counted(self, command, check_health=True):
        writes.append(self)
        return await sent(self, command, check_health)

    monkeypatch.setattr(redis_connection.AbstractConnection, "send_packed_command", counted)
    pipelines, calls = pipeline.pipelines, pipeline.calls
    await asyncio.gather(*(one_request(n, key) for n, key in enumerate(tenants)))
    await settled()
    monkeypatch.undo()
    assert pipeline.calls - calls == 7 * len(tenants)
    ran = await commandstats(redis)
    assert (ran["cmdstat_evalsha"], ran["cmdstat_xadd"]) == (4 * len(tenants), len(tenants))
    assert pipeline.pipelines - pipelines <= 8  # a few turns' worth for 224 calls
    nodes = 3 if "cluster" in redis_url else 1
    assert len(writes) <= (pipeline.pipelines - pipelines) * nodes  # nothing written beside them
