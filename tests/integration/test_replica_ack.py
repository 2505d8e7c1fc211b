"""``quota.replicas_to_acknowledge``: an admission counts only once a replica has
it (Redis WAIT after each pipeline, on its connection), on a Redis Cluster and
on Sentinel. With the replica stopped, what cannot be vouched for is Redis
unreachable (fail_mode), and once the replica answers again nothing is left
held: no lease, no open record."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import redis as sync_redis
from redis_server import RedisSentinelSetup

from serve_app.admission.scripts import AdmissionScripts
from serve_app.errors import OpenAIError
from serve_app.http.services import build_quota_services
from serve_app.identity.keys import KeyRecord
from serve_app.redis_store import redis_client, redis_names
from serve_app.redis_store.auto_pipeline import NotReplicated
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry

TIMEOUT_MS = 300


@pytest.fixture(params=["cluster", "sentinel"])
def replicated(request, redis_cluster, redis_sentinel):
    return redis_cluster if request.param == "cluster" else redis_sentinel


def tenant(n: int | str = 0, **limits) -> KeyRecord:
    return KeyRecord(id=f"kack{n}", name=f"ack{n}", created_at=0, **limits)


def replica_of(servers, client, key_id: str):
    """The replica server of the primary holding ``key_id``'s quota state."""
    if isinstance(servers, RedisSentinelSetup):
        return servers.replica
    primary = client.get_node_from_key(redis_names.concurrency(key_id))
    for node in servers.nodes:
        info = sync_redis.Redis(port=node.port).info("replication")
        if info["role"] == "slave" and info["master_port"] == primary.port:
            return node
    raise AssertionError("no replica of the key's primary")


async def until_replicas_acknowledge(admit) -> None:
    """Run ``admit()`` until its admission is acknowledged: in the first second or
    so after a replica's full sync, WAIT times out here although the replica's
    link is up (seen on every shape). Bounded: a replica that never
    acknowledges fails the test."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return await admit()
        except (NotReplicated, OpenAIError):
            assert time.monotonic() < deadline, "the replicas never acknowledged a write"
            await asyncio.sleep(0.2)


def primary_of(servers, client, key_id: str) -> int:
    if isinstance(servers, RedisSentinelSetup):
        return servers.primary.port
    return client.get_node_from_key(redis_names.concurrency(key_id)).port


async def test_each_admission_is_on_a_replica_when_it_returns(replicated):
    client = redis_client.connect(replicated.url)
    if not isinstance(replicated, RedisSentinelSetup):
        await client.initialize()  # the slot map, to find each key's servers
    adm = AdmissionScripts(
        client, lease_s=600, retention_s=3600, replicas_to_acknowledge=1, acknowledge_timeout_ms=2000
    )
    keys = [tenant(n, max_concurrent=100) for n in range(12)]
    await until_replicas_acknowledge(lambda: adm.admit(tenant("warm"), f"warm-{time.monotonic_ns()}", "m", 1))
    ids = [f"r{n}-{time.monotonic_ns()}" for n in range(len(keys))]
    sync_redis.Redis(port=primary_of(replicated, client, keys[0].id)).config_resetstat()
    decisions = await asyncio.gather(*(adm.admit(key, rid, "m", 1) for key, rid in zip(keys, ids)))
    assert all(decision.admitted for decision in decisions)
    # Read from each key's replica directly, at once: its record is there.
    for key, rid in zip(keys, ids):
        replica = sync_redis.Redis(port=replica_of(replicated, client, key.id).port, single_connection_client=True)
        if not isinstance(replicated, RedisSentinelSetup):
            replica.execute_command("READONLY")  # a cluster replica serves reads of its primary's slots
        assert replica.hget(redis_names.request_record(key.id, rid), "status") == b"admitted"
    waits = sync_redis.Redis(port=primary_of(replicated, client, keys[0].id)).info("commandstats")
    assert waits["cmdstat_wait"]["calls"] >= 1  # on the primary, after its calls
    await client.aclose()


@pytest.mark.parametrize("fail_mode", ["closed", "open"])
async def test_a_replica_that_does_not_answer_makes_admissions_unreachable_and_leaks_nothing(replicated, fail_mode):
    access = build_quota_services(
        AppSettings(
            redis_url=replicated.url,
            quota={
                "redis_timeout_s": 2,
                "fail_mode": fail_mode,
                "replicas_to_acknowledge": 1,
                "replica_ack_timeout_ms": TIMEOUT_MS,
            },
        ),
        Telemetry(False, False),
    )
    key = tenant(f"{fail_mode}-{time.monotonic_ns()}", max_concurrent=3, requests_per_minute=1000)
    warm = await until_replicas_acknowledge(lambda: access.gate.admit(tenant("warm"), "m", 5))
    access.gate.settle(warm, "completed")  # connections open, scripts loaded
    while access.gate._background:
        await asyncio.sleep(0.01)
    replica = replica_of(replicated, access.redis, key.id)
    primary = sync_redis.Redis(port=primary_of(replicated, access.redis, key.id))
    os.kill(replica.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        outcomes = await asyncio.gather(*(access.gate.admit(key, "m", 5) for _ in range(3)), return_exceptions=True)
        took = time.monotonic() - started
        if fail_mode == "closed":
            assert all(isinstance(o, OpenAIError) and o.status == 503 for o in outcomes), outcomes
        else:
            assert all(o.local for o in outcomes), outcomes  # decided on local limits
            for ticket in outcomes:
                access.gate.settle(ticket, "completed")
        assert took < 2, took  # the WAIT timeout, not the Redis timeout
        # The primary ran the admissions: their leases are there, unvouched.
        assert primary.zcard(redis_names.concurrency(key.id)) == 3
        assert await access.gate.flush_unsettled() == 0  # settlements are not vouched for either
    finally:
        os.kill(replica.proc.pid, signal.SIGCONT)
    for _ in range(100):
        await access.gate.flush_unsettled()
        if not access.gate._unsettled and not access.gate._background:
            break
        await asyncio.sleep(0.05)
    assert not access.gate._unsettled
    assert primary.zcard(redis_names.concurrency(key.id)) == 0
    records = list(primary.scan_iter(match=redis_names.request_record_prefix(key.id) + "*", count=1000))
    assert len(records) == 3
    # open: settled as served; closed: the admissions the client saw refused are taken
    # back as withdrawn tombstones (never shipped as a request's record).
    assert {primary.hget(name, "status") for name in records} == (
        {b"completed"} if fail_mode == "open" else {b"withdrawn"}
    )
    await access.redis.aclose()


async def test_without_replicas_nothing_is_vouched_for(redis_server):
    client = redis_client.connect(redis_server.url)
    adm = AdmissionScripts(client, lease_s=600, retention_s=3600, replicas_to_acknowledge=1, acknowledge_timeout_ms=50)
    with pytest.raises(NotReplicated):
        await adm.admit(tenant(7), "r-lonely", "m", 1)
    await client.aclose()
