"""Admissions per second and admission latency: one Redis node vs a Redis Cluster,
from 1 and from 4 gateway processes, for keys alone (one level) and for keys in
teams (two levels: each key's and its team's limits, serve_app/identity/teams.py).

Each process runs what an ingress replica runs per request (serve_app.admission.gatekeeper:
``Gatekeeper.admit`` — one EVALSHA of the admit script — then ``Gatekeeper.settle``, off
the response path) in a closed loop with ``--concurrency`` requests in flight,
over 1,000 API keys with generous limits (admitted, not refused: the full write
path). ``1x1`` (one process, one admission at a time) is the bare round trip;
more in flight measures throughput (latency then includes the queue). Redis servers are started here on loopback (the
cluster: 3 primaries, 3
replicas). Latency is the ``admit`` call as the gateway sees it, client CPU
included; the load generator shares the box with Redis.

    .venv/bin/python bench/admission_throughput.py [--duration 8] [--points 1x1 1x64 4x64] [--levels 1 2]

There is no third level to measure: the hierarchy is team → key (docs/quotas.md,
"Teams"); each level is one more admit script in its own round trip, so a third
would add what the second adds.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from redis_server import running_redis, running_redis_cluster  # noqa: E402

KEYS = 1000


TEAMS = 10  # with two levels: the keys spread over this many teams


def run_process(
    url: str, duration_s: float, concurrency: int, seed: int, results, acknowledge: int = 0, levels: int = 1
) -> None:
    asyncio.run(_drive(url, duration_s, concurrency, seed, results, acknowledge, levels))


async def _drive(
    url: str, duration_s: float, concurrency: int, seed: int, results, acknowledge: int, levels: int
) -> None:
    from contract.replica_wire import Usage
    from serve_app.http.services import build_quota_services
    from serve_app.identity.keys import KeyRecord
    from serve_app.settings import AppSettings
    from serve_app.telemetry import Telemetry

    quota = {"redis_timeout_s": 2, "replicas_to_acknowledge": acknowledge, "replica_ack_timeout_ms": 1000}
    services = build_quota_services(AppSettings(redis_url=url, quota=quota), Telemetry(False, False))
    generous = {"requests_per_minute": 10**7, "tokens_per_minute": 10**9, "max_concurrent": 10**4}
    teams = []
    if levels == 2:
        from serve_app.limits import KeyLimits

        teams = [
            (await services.stores.teams.create(f"bench-{seed}-{time.monotonic_ns()}-{j}", KeyLimits(**generous))).id
            for j in range(TEAMS)
        ]
    keys = [
        KeyRecord(
            id=f"kb{seed}x{i}",
            name=f"bench-{seed}-{i}",
            created_at=0,
            team=teams[i % TEAMS] if teams else None,
            **generous,
        )
        for i in range(KEYS)
    ]
    usage = Usage(prompt_tokens=20, completion_tokens=40)
    for key in keys[:concurrency]:  # scripts loaded, connections open
        services.gate.settle(await services.gate.admit(key, "m", 60), "completed", usage)
    latencies: list[float] = []
    local = 0
    deadline = time.perf_counter() + duration_s

    async def worker(offset: int) -> None:
        nonlocal local
        i = offset
        while time.perf_counter() < deadline:
            key = keys[i % KEYS]
            i += concurrency
            started = time.perf_counter()
            ticket = await services.gate.admit(key, "m", 60)
            latencies.append(time.perf_counter() - started)
            local += ticket.local
            services.gate.settle(ticket, "completed", usage)

    began, cpu_began = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker(n) for n in range(concurrency)))
    took = time.perf_counter() - began
    while services.gate._background:  # settlements still in flight
        await asyncio.sleep(0.01)
    cpu = time.process_time() - cpu_began
    await services.redis.aclose()
    results.put((len(latencies), took, latencies[::10], local, cpu))


def redis_cpu_s(ports: list[int]) -> float:
    """CPU seconds the redis-server processes on ``ports`` have used (INFO cpu)."""
    import redis

    total = 0.0
    for port in ports:
        client = redis.Redis(port=port)
        info = client.info("cpu")
        total += info["used_cpu_sys"] + info["used_cpu_user"]
        client.close()
    return total


def measure(
    url: str,
    ports: list[int],
    processes: int,
    duration_s: float,
    concurrency: int,
    acknowledge: int = 0,
    levels: int = 1,
) -> dict:
    redis_before = redis_cpu_s(ports)
    results = multiprocessing.get_context("spawn").Queue()
    workers = [
        multiprocessing.get_context("spawn").Process(
            target=run_process, args=(url, duration_s, concurrency, n, results, acknowledge, levels)
        )
        for n in range(processes)
    ]
    for worker in workers:
        worker.start()
    parts = [results.get(timeout=duration_s + 120) for _ in workers]
    for worker in workers:
        worker.join()
    count = sum(part[0] for part in parts)
    took = max(part[1] for part in parts)
    sampled = sorted(latency for part in parts for latency in part[2])
    assert not sum(part[3] for part in parts), "some admissions fell back to local limits: Redis timed out"
    return {
        "admissions/s": count / took,
        "p50 ms": 1000 * statistics.median(sampled),
        "p99 ms": 1000 * sampled[int(0.99 * (len(sampled) - 1))],
        "gateway us": 1e6 * sum(part[4] for part in parts) / count,
        "redis us": 1e6 * (redis_cpu_s(ports) - redis_before) / count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per point")
    parser.add_argument(
        "--points",
        nargs="+",
        default=["1x1", "1x64", "4x64"],
        help="PROCESSESxIN_FLIGHT per process: 1x1 is the bare round trip, the others throughput",
    )
    parser.add_argument(
        "--levels", nargs="+", type=int, default=[1, 2], choices=[1, 2], help="1: keys alone; 2: keys in teams"
    )
    parser.add_argument("--no-wait", action="store_true", help="leave out the WAIT-for-a-replica cluster rows")
    args = parser.parse_args()
    points = [tuple(int(n) for n in point.split("x")) for point in args.points]
    rows = []
    with running_redis() as node, running_redis_cluster() as cluster:
        cluster_ports = [n.port for n in cluster.nodes]
        targets = [
            ("one node", node.url, [node.port], 0),
            ("cluster, 3 primaries", cluster.url, cluster_ports, 0),
            ("cluster, 3 primaries, WAIT 1 replica", cluster.url, cluster_ports, 1),
        ]
        if args.no_wait:
            targets.pop()
        for name, url, ports, acknowledge in targets:
            for levels in args.levels:
                for processes, in_flight in points:
                    rows.append(
                        (
                            name,
                            levels,
                            processes,
                            in_flight,
                            measure(url, ports, processes, args.duration, in_flight, acknowledge, levels),
                        )
                    )
    print(
        f"\nadmit (one EVALSHA per level) + settle per request, {args.duration:.0f} s per point, {KEYS} keys; "
        f"CPU per admitted request: the gateway processes' and every redis-server's (replicas included)\n"
    )
    print(
        "| Redis | levels | gateway processes | in flight per process | admissions/s | admit p50 ms | admit p99 ms "
        "| gateway CPU µs | Redis CPU µs |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, levels, processes, in_flight, figures in rows:
        print(
            f"| {name} | {levels} | {processes} | {in_flight} | {figures['admissions/s']:,.0f} | "
            f"{figures['p50 ms']:.2f} | "
            f"{figures['p99 ms']:.2f} | {figures['gateway us']:.0f} | {figures['redis us']:.0f} |"
        )


if __name__ == "__main__":
    main()
