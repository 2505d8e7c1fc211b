"""One soak run, start to verdict: Redis Cluster behind chaos proxies, the gateway
on the `ray up` twin, tenants, the load, faults and admin changes on a schedule,
then the rest state and the records gathered and judged (soak/ledger.py).

    python -m soak --duration 1800 --seed 7          # `make soak DURATION=1800 SEED=7`
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from serve_app.settings import QuotaConfig
from soak import faults as fault_kinds
from soak.ledger import Account, Fault, Limits, Record, Verdict, judge, max_overlap, summary
from soak.redis_probe import RedisPathProbe
from soak.stall_watch import StallWatch
from soak.tenants import Tenant, as_body, provision
from soak.topology import PRICES, ProxiedRedisCluster, Twin, free_port, run_dir, serve_config
from soak.traffic import Load, now_ms

ADMIN_TOKEN = "soak-admin-token-of-32-characters"
# The Redis path counts as slow past this: half the shipped quota.redis_timeout_s. The
# gateway sheds rather than admits on local limits while its loop runs a quarter late,
# and a call waits on the loop at least twice: a call that failed below that spent at
# least half the timeout on the path.
SLOW_REDIS_S = QuotaConfig().redis_timeout_s / 2


@dataclass
class Shape:
    duration_s: float = 300
    seed: int = 1
    keys: int = 2000
    teams: int = 50
    clients: int = 200
    ingress_replicas: int = 8
    paced_replicas: int = 2
    token_interval_s: float = 0.05  # the paced models' pace: longer, more streams open per CPU
    lease_s: float = 60  # quota.concurrency_lease_s, as shipped; short runs take less to see reaping
    # How long after the load every batch must have ended: half to end on its own (its
    # requests run on after the load), then cancelled, half to end from its cancel
    # (within a runner's poll, or a dead runner's lease: 15 s).
    batch_end_s: float = 120
    with_vllm: bool = True
    faults: list[str] = field(default_factory=lambda: list(fault_kinds.KINDS))


@dataclass
class AdminChanges:
    """Limits lowered and keys and teams revoked mid-run, when each call returned."""

    periods: dict[str, list[tuple[int, Limits]]] = field(default_factory=dict)
    revoked: dict[str, int] = field(default_factory=dict)


async def admin_changes(base_url: str, tenants: list[Tenant], teams: dict[str, Limits], at_s: float) -> AdminChanges:
    """At ``at_s``: the three busiest keys' limits halved, the next two keys revoked,
    and the team of the sixth revoked (the traffic is Zipf: low ranks are busiest)."""
    await asyncio.sleep(at_s)
    changes = AdminChanges()
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30) as admin:
        for tenant in tenants[:3]:
            old = tenant.limits
            lower = Limits(
                requests_per_minute=max(1, old.requests_per_minute // 2) if old.requests_per_minute else 6,
                tokens_per_minute=max(100, old.tokens_per_minute // 2) if old.tokens_per_minute else 1000,
                max_concurrent=max(1, old.max_concurrent // 2) if old.max_concurrent else 1,
                daily_token_budget=old.daily_token_budget,
                daily_cost_nanos=old.daily_cost_nanos,
            )
            await _admin_call(admin, "PATCH", f"/admin/keys/{tenant.key_id}", as_body(lower))
            changes.periods[tenant.key_id] = [(0, old), (now_ms(), lower)]
        for tenant in tenants[3:5]:
            await _admin_call(admin, "DELETE", f"/admin/keys/{tenant.key_id}")
            changes.revoked[tenant.key_id] = now_ms()
        team = tenants[5].team_id
        await _admin_call(admin, "DELETE", f"/admin/teams/{team}")
        changes.revoked[team] = now_ms()
    print(f"  admin: 3 keys' limits halved, 2 keys and team {team} revoked", flush=True)
    return changes


async def _admin_call(admin: httpx.AsyncClient, method: str, path: str, body: dict | None = None) -> None:
    """One admin call, retried as an operator's script would while a fault has the
    edge or Redis down (the change takes effect when it returns)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            answer = await admin.request(method, path, json=body)
            if answer.status_code == 200:
                return
            failure = f"{answer.status_code} {answer.text[:200]}"
            edge_not_ready = answer.status_code == 404 and not answer.text.startswith("{")  # a restarted edge
            if answer.status_code < 500 and not edge_not_ready:
                raise AssertionError(f"{method} {path}: {failure}")
        except httpx.HTTPError as exc:
            failure = repr(exc)
        assert time.monotonic() < deadline, f"{method} {path} kept failing: {failure}"
        await asyncio.sleep(1)


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def as_record(fields: dict[str, Any], account: str | None = None) -> Record:
    finished = _int(fields.get("finished_ms"))
    admitted = _int(fields.get("received_ms"), finished)  # admitted on local limits: no admission time kept
    prompt = fields.get("prompt_tokens")
    completion = fields.get("completion_tokens")
    charged = _int(fields.get("total_tokens"))
    if prompt is not None and fields.get("usage") != "reserved":
        cost = _int(prompt) * int(PRICES["prompt_per_million"] * 1000) + _int(completion) * int(
            PRICES["completion_per_million"] * 1000
        )
    else:
        cost = _int(fields.get("reserved_nanos"))
    return Record(
        id=str(fields.get("id") or fields.get("request_id") or ""),
        account=account or str(fields.get("key_id")),
        status=str(fields.get("status")),
        admitted_ms=admitted,
        finished_ms=finished or admitted,
        charged_tokens=charged,
        reserved_tokens=_int(fields.get("reserved_tokens"), charged) if fields.get("admission") != "local" else charged,
        cost_nanos=cost,
        http_request_id=str(fields.get("http_request_id") or ""),
        prompt_tokens=_int(prompt) if prompt is not None and fields.get("usage") != "reserved" else None,
        completion_tokens=_int(completion) if completion is not None and fields.get("usage") != "reserved" else None,
        local=fields.get("admission") == "local",
        unadmitted=fields.get("admission") == "none",
        failover=str(fields.get("failover") or ""),
    )


def gather_records(
    redis_cluster: ProxiedRedisCluster, sink: Path, key_ids: set[str], team_ids: set[str]
) -> tuple[list[dict], list[dict], int]:
    """Every final record of the run's keys (the sink's, then Redis': those not shipped
    yet, and any left open), every record of its teams' own admissions (kept in Redis
    only, never shipped), and how many key records Redis still held."""
    import redis

    keys: list[dict] = []
    for path in sorted(sink.rglob("*.jsonl")):
        for line in path.read_text().splitlines():
            keys.append(json.loads(line))
    teams: list[dict] = []
    in_redis = 0
    for node in redis_cluster.nodes:
        client = redis.Redis(port=node.port, decode_responses=True)
        if client.info("replication")["role"] != "master":
            continue
        for name in client.scan_iter(match="llm:req:*", count=1000):
            fields = client.hgetall(name)
            fields.setdefault("id", name.rsplit(":", 1)[-1])
            if fields.get("key_id") in key_ids:
                keys.append(fields)
                in_redis += 1
            elif fields.get("key_id") in team_ids:
                teams.append(fields)
    return keys, teams, in_redis


def leases_at_rest(redis_cluster: ProxiedRedisCluster, account_ids: list[str]) -> dict[str, int]:
    """Live concurrency leases (not yet expired) per account, read on its primary."""
    from redis.cluster import ClusterNode, RedisCluster

    from serve_app.redis_store import redis_names

    client = RedisCluster(
        startup_nodes=[ClusterNode("127.0.0.1", redis_cluster.nodes[0].port)], address_remap=_unproxied(redis_cluster)
    )
    now = time.time() * 1000
    try:
        pipe = client.pipeline()
        for account in account_ids:
            pipe.zcount(redis_names.concurrency(account), now, "+inf")
        return dict(zip(account_ids, pipe.execute()))
    finally:
        client.close()


def why_open(redis_cluster: ProxiedRedisCluster, verdict: Verdict) -> None:
    """For each record left open at rest, what the reaper had to go by: its account's
    place in the due index and its request's lease (to tell a lost registration from a
    reaper that did not run)."""
    from redis.cluster import ClusterNode, RedisCluster

    from serve_app.redis_store import redis_names

    found = [v for v in verdict.violations if v.check == "open record"]
    if not found:
        return
    client = RedisCluster(
        startup_nodes=[ClusterNode("127.0.0.1", redis_cluster.nodes[0].port)], address_remap=_unproxied(redis_cluster)
    )
    try:
        now = time.time() * 1000
        for violation in found:
            request_id = violation.detail.split(" ", 1)[0]
            due = client.zscore(redis_names.LEASES_DUE, violation.subject)
            lease = client.zscore(redis_names.concurrency(violation.subject), request_id)
            violation.detail += (
                f"; due index: {'none' if due is None else f'{(due - now) / 1000:+.0f} s'}, "
                f"lease: {'none' if lease is None else f'{(lease - now) / 1000:+.0f} s'}"
            )
    finally:
        client.close()


def _unproxied(redis_cluster: ProxiedRedisCluster):
    by_proxy = {proxy.listen_port: node.port for proxy, node in zip(redis_cluster.proxies, redis_cluster.nodes)}
    return lambda address: (address[0], by_proxy.get(address[1], address[1]))


def wait_until_ready(base_url: str, timeout_s: float = 300) -> None:
    """Until ``/ready`` answers 200 through the edge three times in a row, a second apart."""
    deadline, in_a_row = time.monotonic() + timeout_s, 0
    while in_a_row < 3:
        try:
            in_a_row = in_a_row + 1 if httpx.get(base_url + "/ready", timeout=5).status_code == 200 else 0
        except httpx.HTTPError:
            in_a_row = 0
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url}/ready did not answer 200 within {timeout_s:.0f} s")
        time.sleep(1)


async def soak(shape: Shape) -> Verdict:
    from serve_app.admin.operations import AdminStores
    from serve_app.redis_store.redis_client import connect

    # The edge is HAProxy only with the Serve settings the Makefile exports; without
    # them Serve's proxy actor holds the port and the haproxy-restart fault has no
    # HAProxy to restart (a soak run by plain pytest, twice).
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        raise SystemExit("the soak needs the Makefile's Serve settings: run `make soak` (or `make test`)")
    folder = run_dir()
    print(f"soak: seed {shape.seed}, {shape.duration_s:.0f} s, run folder {folder}", flush=True)
    redis_cluster = ProxiedRedisCluster()
    redis_cluster.start()
    twin = Twin(redis_cluster.url, ADMIN_TOKEN, folder)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        stores_redis = connect(redis_cluster.url)
        stores = AdminStores.over(stores_redis)
        tenants, teams = await provision(stores, shape.seed, shape.keys, shape.teams)
        await stores_redis.aclose()
        print(f"  {len(tenants)} keys in {len(teams)} teams made in {time.monotonic() - started:.0f} s", flush=True)
        started = time.monotonic()
        await asyncio.to_thread(twin.up)
        config = serve_config(
            port,
            folder,
            shape.ingress_replicas,
            shape.paced_replicas,
            shape.token_interval_s,
            shape.with_vllm,
            shape.lease_s,
        )
        await asyncio.to_thread(twin.deploy, config)
        # Serve's RUNNING is not yet the edge's: the load starts when /ready says so through
        # HAProxy, as a load balancer would send the first client (run 10 met HAProxy's own
        # 503s for ~10 s after RUNNING, before any fault).
        await asyncio.to_thread(wait_until_ready, base_url)
        print(f"  twin up and deployed in {time.monotonic() - started:.0f} s, {twin.nodes()} Ray nodes", flush=True)
        verdict, figures = await _run(shape, redis_cluster, twin, base_url, tenants, teams, folder)
        verdict.run_folder = str(folder)
        print_report(shape, verdict, figures)
    finally:
        await asyncio.to_thread(twin.down)
        redis_cluster.stop()
    return verdict


async def _run(shape, redis_cluster, twin, base_url, tenants, teams, folder) -> tuple[Verdict, dict]:
    ctx = fault_kinds.Context(redis_cluster, twin, base_url)
    load = Load(base_url, tenants, shape.seed, shape.clients, shape.with_vllm)
    stop = asyncio.Event()
    quiet_s = max(30.0, shape.lease_s * 2)  # no fault in the last stretch: the rest state is then the gateway's own
    probe = RedisPathProbe([proxy.listen_port for proxy in redis_cluster.proxies], SLOW_REDIS_S).start()
    stall_watch = StallWatch(folder, twin.cli).start()
    load_task = asyncio.create_task(load.run(stop))
    began_ms, began = now_ms(), time.monotonic()
    schedule = asyncio.create_task(
        fault_kinds.run_schedule(ctx, shape.faults, shape.seed, 0.1 * shape.duration_s, shape.duration_s - quiet_s)
    )
    changes_task = asyncio.create_task(admin_changes(base_url, tenants, teams, 0.5 * shape.duration_s))
    await asyncio.sleep(max(0.0, shape.duration_s - (time.monotonic() - began)))
    faults: list[Fault] = await schedule
    changes = await changes_task
    stop.set()
    await load_task
    elapsed_s = time.monotonic() - began
    unended, cancelled = await load.end_batches(timeout_s=shape.batch_end_s)
    slow_redis = await asyncio.to_thread(probe.stop)
    stalls = await asyncio.to_thread(stall_watch.stop)
    await asyncio.sleep(3)  # the last settlements and the shippers' next pass
    # Leases: the load is over, its last fault long undone: any live lease is a leak.
    key_ids = {tenant.key_id for tenant in tenants}
    accounts_ids = sorted(key_ids | set(teams))
    running = await asyncio.to_thread(leases_at_rest, redis_cluster, accounts_ids)
    await asyncio.sleep(5)  # the shippers empty the outbox to the sink
    raw, raw_teams, in_redis = await asyncio.to_thread(
        gather_records, redis_cluster, folder / "records", key_ids, set(teams)
    )
    key_records = [as_record(fields) for fields in raw]
    # A team's limits are judged on its own admissions' records: their times are Redis'
    # on the team's shard, when the team's lease was taken and given back (a key's record
    # times its own level, up to a pipeline's flush apart from its team's).
    team_records = [as_record(fields) for fields in raw_teams]
    accounts = []
    for tenant in tenants:
        periods = changes.periods.get(tenant.key_id, [(0, tenant.limits)])
        revoked = min(
            [changes.revoked[x] for x in (tenant.key_id, tenant.team_id) if x in changes.revoked], default=None
        )
        accounts.append(Account(tenant.key_id, periods, revoked))
    accounts += [Account(team, [(0, limits)], changes.revoked.get(team)) for team, limits in teams.items()]
    revoked_keys = {a.id: a.revoked_ms for a in accounts if a.revoked_ms is not None and a.id in key_ids}
    observations = [
        seen for seen in load.observations if seen.key not in revoked_keys or seen.ended_ms < revoked_keys[seen.key]
    ]
    keep_history(folder, raw + raw_teams, load.observations, faults + slow_redis)
    verdict = judge(accounts, key_records + team_records, observations, faults + slow_redis, running, key_ids)
    await asyncio.to_thread(why_open, redis_cluster, verdict)
    verdict.counts["records still in Redis at the end"] = in_redis
    verdict.counts["batches created"] = len(load.batches)
    verdict.counts["batches cancelled after the load (parked: their key at a limit)"] = cancelled
    for batch_id, last in unended.items():
        verdict.fail(
            "batch ended",
            batch_id,
            f"not ended {shape.batch_end_s:.0f} s after the load stopped, "
            f"{shape.batch_end_s / 2:.0f} s after its cancel ({last})",
        )
    # Time to admission: from the client's send to Redis' clock in the record (one machine, one clock).
    sent = {seen.http_request_id: seen.started_ms for seen in load.observations}
    to_admission = sorted(
        r.admitted_ms - sent[r.http_request_id] for r in key_records if not r.local and r.http_request_id in sent
    )
    streams = [(seen.started_ms, seen.ended_ms) for seen in load.observations if seen.streaming and seen.status == 200]
    figures = {
        "streams_at_once": max_overlap(streams)[0],
        "to_admission_ms": to_admission,
        "elapsed_s": elapsed_s,
        "began_ms": began_ms,
        "statuses": collections.Counter(seen.status for seen in load.observations),
        "admitted": sum(1 for seen in load.observations if seen.status == 200),
        "requests": len(load.observations),
        "latencies_ms": load.latencies_ms,
        "faults": faults,
        "slow_redis": slow_redis,
        "stalls": stalls,
    }
    return verdict, figures


def keep_history(folder: Path, raw_records: list[dict], observations, faults) -> None:
    """What the ledger judged, in the run folder, to look into a verdict afterwards."""
    with open(folder / "records.jsonl", "w") as out:
        out.writelines(json.dumps(fields) + "\n" for fields in raw_records)
    with open(folder / "observations.jsonl", "w") as out:
        out.writelines(json.dumps(dataclasses.asdict(seen)) + "\n" for seen in observations)
    (folder / "faults.json").write_text(json.dumps([dataclasses.asdict(fault) for fault in faults], indent=1))


def _pct(ordered: list, q: int) -> float:
    return ordered[min(len(ordered) - 1, len(ordered) * q // 100)]


def print_report(shape: Shape, verdict: Verdict, figures: dict) -> None:
    elapsed = figures["elapsed_s"]
    lat = sorted(figures["latencies_ms"]) or [float("nan")]
    admit = figures["to_admission_ms"] or [float("nan")]
    rows = [
        (
            "run",
            f"{elapsed:.0f} s, seed {shape.seed}, {shape.keys} keys / {shape.teams} teams, {shape.clients} clients",
        ),
        (
            "shape",
            f"{shape.ingress_replicas} ingress replicas, Redis Cluster 3+3 behind proxies, vLLM {shape.with_vllm}",
        ),
        ("requests/s (all answers)", f"{figures['requests'] / elapsed:.1f}"),
        ("admissions/s (200s)", f"{figures['admitted'] / elapsed:.1f}"),
        ("streams open at once (most)", str(figures["streams_at_once"])),
        ("statuses", ", ".join(f"{k}: {v}" for k, v in sorted(figures["statuses"].items()))),
        ("client send → first byte p50 / p99 ms", f"{_pct(lat, 50):.0f} / {_pct(lat, 99):.0f}"),
        ("client send → admitted in Redis p50 / p99 ms", f"{_pct(admit, 50):.0f} / {_pct(admit, 99):.0f}"),
    ]
    for name, values in sorted(verdict.overshoot.items()):
        rows.append((f"overshoot {name} (× limit)", summary(values)))
    for name, count in sorted(verdict.counts.items()):
        rows.append((name, str(count)))
    for fault in figures["faults"]:
        recoveries = [v for k, v in verdict.recovery_ms.items() if k == f"{fault.kind}@{fault.started_ms}"]
        worst = max(recoveries[0]) / 1000 if recoveries else 0.0
        rows.append(
            (
                f"fault {fault.kind}",
                f"{'undone in' if fault.undone else 'NOT undone, given up after'} "
                f"{(fault.healed_ms - fault.started_ms) / 1000:.1f} s; "
                f"failures seen until +{worst:.1f} s ({len(recoveries[0]) if recoveries else 0})",
            )
        )
    slow = [fault.healed_ms - fault.started_ms for fault in figures["slow_redis"]]
    rows.append(
        (
            f"Redis path slower than {SLOW_REDIS_S * 1000:.0f} ms or not answering (the probe's)",
            f"{len(slow)} times, {sum(slow) / 1000:.1f} s in all, longest {max(slow, default=0) / 1000:.1f} s",
        )
    )
    rows.append(("replicas the controller lost touch with (soak/stall_watch.py)", str(len(figures["stalls"]))))
    width = max(len(name) for name, _ in rows)
    print("\n| what | figure |\n|---|---|")
    for name, value in rows:
        print(f"| {name.ljust(width)} | {value} |")
    for stall in figures["stalls"]:
        print(f"  stalled: {stall}")
    print(f"\nledger: {'PASSED' if verdict.passed else 'FAILED'} ({len(verdict.violations)} violations)")
    by_check = collections.defaultdict(list)
    for violation in verdict.violations:
        by_check[violation.check].append(violation)
    for check, found in by_check.items():
        print(f"  {check}: {len(found)}")
        for violation in found[:5]:
            print(f"    {violation.subject}: {violation.detail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keys", type=int, default=2000)
    parser.add_argument("--teams", type=int, default=50)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--ingress-replicas", type=int, default=8)
    parser.add_argument("--token-interval", type=float, default=0.05, help="the paced models' s per token")
    parser.add_argument("--lease", type=float, default=60, help="quota.concurrency_lease_s")
    parser.add_argument("--no-vllm", action="store_true", help="every model paced (no real engine)")
    parser.add_argument("--faults", nargs="*", default=list(fault_kinds.KINDS), choices=list(fault_kinds.KINDS))
    args = parser.parse_args(argv)
    shape = Shape(
        duration_s=args.duration,
        seed=args.seed,
        keys=args.keys,
        teams=args.teams,
        clients=args.clients,
        ingress_replicas=args.ingress_replicas,
        token_interval_s=args.token_interval,
        lease_s=args.lease,
        with_vllm=not args.no_vllm,
        faults=args.faults,
    )
    random.seed(args.seed)
    verdict = asyncio.run(soak(shape))
    return 0 if verdict.passed else 1
