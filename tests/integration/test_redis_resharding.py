"""A Redis Cluster moves the slot of a key's quota state to another primary while
16 clients hammer that key (docs/quotas.md, "Redis: one node, a Redis Cluster, or
Sentinel"): the slot is set MIGRATING/IMPORTING and its keys are moved a few at a
time, so admissions, settlements and renewals meet ASK redirects and TRYAGAIN
(a script whose keys are split between the two nodes) on their way, inside
auto-pipelines. The client follows them: no request decided without Redis, no
500, the limit as exact as without the move, and afterwards every key on the
new primary, no lease, no record left open."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis as sync_redis
from redis_server import _cli, running_redis_cluster
from test_redis_failover import CLIENTS, RPM, Tally, client_loop, redis_allowance, settled_everything

from contract.replica_wire import Usage
from serve_app.admission.seam import Ticket
from serve_app.http.services import build_quota_services
from serve_app.identity.keys import KeyStore
from serve_app.limits import KeyLimits
from serve_app.redis_store import redis_names
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry

# Keys per MIGRATE and the pause between two, as `redis-cli --cluster reshard`
# moves a slot (10 keys per MIGRATE) on a busy box: the slot is half moved for
# tens of ms. (Half moved for longer than the client's ~0.4 s of TRYAGAIN
# retries, a call gives up: fail_mode applies.)
MIGRATE_BATCH = 10


@pytest.fixture
def cluster():
    """Its own 3 primaries (no replicas): this test moves a slot."""
    with running_redis_cluster(primaries=3, replicas=0) as servers:
        yield servers


def node_ids(port: int) -> dict[int, str]:
    """Port → node id, as the cluster knows its nodes."""
    ids = {}
    for line in _cli(port, "cluster", "nodes").splitlines():
        node_id, address = line.split()[:2]
        ids[int(address.split("@")[0].rsplit(":", 1)[1])] = node_id
    return ids


async def move_slot(slot: int, source: int, target: int, every_port: list[int]) -> int:
    """Move ``slot`` from port ``source`` to port ``target`` as `redis-cli --cluster
    reshard` does, a few keys per MIGRATE; returns the keys moved."""
    ids = node_ids(source)
    src, dst = sync_redis.Redis(port=source), sync_redis.Redis(port=target)
    dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[source])
    src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[target])
    moved = 0
    while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, MIGRATE_BATCH):
        src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
        moved += len(keys)
        await asyncio.sleep(0.01)  # requests keep arriving while the slot is half moved
    for port in every_port:
        sync_redis.Redis(port=port).execute_command("CLUSTER SETSLOT", slot, "NODE", ids[target])
    return moved


def redirections(cluster) -> dict[str, int]:
    """ASK, TRYAGAIN and MOVED answers the cluster's nodes gave (INFO errorstats)."""
    counts: dict[str, int] = {}
    for node in cluster.nodes:
        for name, stats in sync_redis.Redis(port=node.port).info("errorstats").items():
            kind = name.removeprefix("errorstat_")
            if kind in ("ASK", "TRYAGAIN", "MOVED"):
                counts[kind] = counts.get(kind, 0) + stats["count"]
    return counts


async def test_admissions_follow_a_slot_moved_under_load_and_stay_exact(cluster):
    settings = AppSettings(
        redis_url=cluster.url,
        quota={"fail_mode": "closed", "redis_timeout_s": 2, "key_cache_ttl_s": 1, "concurrency_lease_s": 10},
    )
    services = build_quota_services(settings, Telemetry(False, False))
    record, secret = await KeyStore(services.redis).create("resharded", KeyLimits(requests_per_minute=RPM))
    slot = services.redis.keyslot(redis_names.requests_rate(record.id))
    source = services.redis.get_node_from_key(redis_names.requests_rate(record.id)).port
    target = next(node.port for node in cluster.nodes if node.port != source)
    tally, stop = Tally(), asyncio.Event()
    started = time.monotonic()
    clients = [asyncio.create_task(client_loop(services, secret, tally, stop)) for _ in range(CLIENTS)]
    try:
        await asyncio.sleep(1.0)
        for node in cluster.nodes:
            sync_redis.Redis(port=node.port).config_resetstat()
        moved = await move_slot(slot, source, target, [node.port for node in cluster.nodes])
        redirects = redirections(cluster)
        await asyncio.sleep(1.0)
        # Renewals and a late settlement on the moved slot too.
        await services.gate.renew_leases()
    finally:
        stop.set()
        await asyncio.gather(*clients)
    took = time.monotonic() - started
    print(
        f"\nresharding: {dict(tally.outcomes)} in {took:.1f} s; {moved} keys moved; redirections answered: {redirects}"
    )
    # Calls met the move (ASK: keys gone; TRYAGAIN: keys split; MOVED: after it) and followed it.
    assert moved >= 10 and sum(redirects.values()) > 0, redirects
    # Closed mode: a call that ran out of redirections (redis-py's ASKING and its
    # command can go on two pooled connections: ASK, MOVED, ASK...) is an outage of
    # the slot, a 503 "unavailable" (fail_mode), never "Redis refused" nor a 500;
    # a few at most, while the slot is half moved.
    assert set(tally.outcomes) <= {"admitted", "429 rate_limit_exceeded", "503 quota_backend_unavailable"}, (
        tally.outcomes,
        tally.causes,
    )
    assert tally.outcomes["503 quota_backend_unavailable"] <= CLIENTS, tally.outcomes
    assert tally.outcomes["admitted"] <= redis_allowance(took), (tally.outcomes, redis_allowance(took))
    assert tally.outcomes["admitted"] >= RPM  # the burst, at least: the limit, not an outage, refused the rest
    assert services.redis.get_node_from_key(redis_names.requests_rate(record.id)).port == target
    assert not sync_redis.Redis(port=source).execute_command("CLUSTER COUNTKEYSINSLOT", slot)
    await settled_everything(services, record.id)
    admitted = []  # still limited on the new primary
    while isinstance(
        ticket := await services.gate.admit(
            await services.authenticator.authenticate({"authorization": f"Bearer {secret}"}), "m", 1
        ),
        Ticket,
    ):
        assert len(admitted) < RPM, "admitted past the limit"
        admitted.append(ticket)
        services.gate.settle(ticket, "completed", Usage(prompt_tokens=1, completion_tokens=1))
    assert ticket.kind == "requests"
    await services.redis.aclose()
