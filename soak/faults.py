"""Faults on a schedule, under load: each is injected, held, undone, and kept as a
ledger Fault (kind, when it began, when the harness had undone it). The schedule
is the seed's order of ``KINDS`` spread over the run's middle, so a fault's window
never overlaps the next and the last minutes are quiet (the ledger checks the rest
state after them)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import psutil

from soak.ledger import Fault
from soak.topology import APP, PACED, PACED_FIRST_TOKEN_TIMEOUT_S, ProxiedRedisCluster, Twin, processes
from soak.traffic import now_ms

HOLD_S = 4.0  # how long a held fault (a pause, a slow or cutting network) lasts


@dataclass
class Context:
    redis: ProxiedRedisCluster
    twin: Twin
    base_url: str


def _kill_one(mark: str, rng: random.Random) -> int:
    found = processes(mark)
    assert found, f"no process holds {mark!r}"
    victim = rng.choice(found)
    os.kill(victim.pid, signal.SIGKILL)
    return victim.pid


async def _until(check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            raise TimeoutError("the fault was not undone in time")
        await asyncio.sleep(0.5)


def _replicas_running(ctx: Context, mark: str, count: int) -> bool:
    return len(processes(mark)) >= count and ctx.twin.app_status() == "RUNNING"


async def _kill_replica(ctx: Context, mark: str, rng: random.Random) -> bool:
    """SIGKILL one replica of ``mark``; undone once Serve runs as many as before."""
    before = len(processes(mark))
    await asyncio.to_thread(_kill_one, mark, rng)
    await asyncio.sleep(2)
    # Serve restarts a replica within ~100 s on this box at load average 25 (a vLLM-free
    # paced model; its health check, then a new actor): a bound with room, not a target.
    await _until(lambda: _replicas_running(ctx, mark, before), 300)
    return False


async def ingress_kill(ctx: Context, rng: random.Random) -> bool:
    return await _kill_replica(ctx, f"ServeReplica:{APP}:Ingress", rng)


async def model_kill(ctx: Context, rng: random.Random) -> bool:
    return await _kill_replica(ctx, f"ServeReplica:{APP}:model-{PACED}", rng)


async def model_stall(ctx: Context, rng: random.Random) -> bool:
    """SIGSTOP one replica of the ingress path's paced model (of two) for twice its
    ``first_token_timeout_s``, then SIGCONT: a stream sent there before Serve's health
    check (30 s) notices is silent, aborted by the ingress and sent to the other replica,
    under its one admission (the ledger: one final record and one charge each); one that
    had sent bytes waits and goes on. Its process lives on, so there is nothing to restart."""
    mark = f"ServeReplica:{APP}:model-{PACED}"
    found = processes(mark)
    victim = rng.choice(found)
    victim.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(2 * PACED_FIRST_TOKEN_TIMEOUT_S)
    finally:
        victim.send_signal(signal.SIGCONT)
    await _until(lambda: _replicas_running(ctx, mark, len(found)), 120)
    return False


async def _kill_redis_node(ctx: Context, role: str, down_s: float) -> bool:
    """SIGKILL a node of ``role``; start it again after ``down_s`` (a primary's replica
    is promoted meanwhile: node timeout 2 s and an election; it comes back as a
    replica); undone once the cluster is whole again."""
    node = ctx.redis.node_with_role(role)
    proc = node.proc
    assert proc is not None  # node_with_role finds a node among the running ones
    proc.kill()
    proc.wait()
    node.proc = None
    await asyncio.sleep(down_s)
    node.start()
    await _until(ctx.redis.healthy, 60)
    return True


async def redis_primary_kill(ctx: Context, rng: random.Random) -> bool:
    return await _kill_redis_node(ctx, "master", 6)


async def redis_replica_kill(ctx: Context, rng: random.Random) -> bool:
    return await _kill_redis_node(ctx, "slave", HOLD_S)


async def redis_pause(ctx: Context, rng: random.Random) -> bool:
    import redis

    node = ctx.redis.node_with_role("master")
    redis.Redis(port=node.port).execute_command("CLIENT", "PAUSE", int(HOLD_S * 1000), "WRITE")
    await asyncio.sleep(HOLD_S)
    return True


async def network_latency(ctx: Context, rng: random.Random) -> bool:
    for proxy in ctx.redis.proxies:
        proxy.latency_s = 0.15
    await asyncio.sleep(HOLD_S)
    for proxy in ctx.redis.proxies:
        proxy.latency_s = 0.0
    return True


async def network_resets(ctx: Context, rng: random.Random) -> bool:
    """Every connection to Redis reset, and new ones refused for a while."""
    for proxy in ctx.redis.proxies:
        proxy.refuse = True
        proxy.reset()
    await asyncio.sleep(HOLD_S / 2)
    for proxy in ctx.redis.proxies:
        proxy.refuse = False
    return True


def edge_listeners(base_url: str) -> list[psutil.Process]:
    """The processes listening on the edge's port: HAProxy's (two while a reload
    drains the old one), found by the socket rather than by name."""
    port = httpx.URL(base_url).port
    pids = {
        conn.pid
        for conn in psutil.net_connections("tcp")
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid
    }
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found.append(psutil.Process(pid))
    return found


async def haproxy_restart(ctx: Context, rng: random.Random) -> bool:
    """SIGKILL every process listening on the edge's port (Serve's proxy actor starts
    HAProxy again); undone once the edge answers. The edge may be between two HAProxy
    processes when the fault comes (the proxy actor starts a new one after a health
    check it missed under load): the fault waits for a listener. Clients that met no
    edge meanwhile are the ledger's to judge (availability outside the faults' windows)."""
    await _until(lambda: bool(edge_listeners(ctx.base_url)), 60)
    listeners = await asyncio.to_thread(edge_listeners, ctx.base_url)
    names = {proc.name() for proc in listeners}
    assert names == {"haproxy"}, f"the edge's port is held by {names}, not HAProxy alone"
    for proc in listeners:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()

    def answers() -> bool:
        try:
            return httpx.get(f"{ctx.base_url}/health", timeout=2).status_code < 500
        except httpx.HTTPError:
            return False

    await asyncio.sleep(1)
    await _until(answers, 120)
    return False


KINDS: dict[str, Callable[[Context, random.Random], Awaitable[bool]]] = {
    "ingress-kill": ingress_kill,
    "redis-primary-kill": redis_primary_kill,
    "network-latency": network_latency,
    "model-kill": model_kill,
    "model-stall": model_stall,
    "redis-pause": redis_pause,
    "redis-replica-kill": redis_replica_kill,
    "network-resets": network_resets,
    "haproxy-restart": haproxy_restart,
}


async def run_schedule(ctx: Context, kinds: list[str], seed: int, start_s: float, end_s: float) -> list[Fault]:
    """Inject ``kinds`` (in the seed's order) evenly between start_s and end_s after now."""
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    began = time.monotonic()
    spacing = (end_s - start_s) / max(len(order), 1)
    done: list[Fault] = []
    for index, kind in enumerate(order):
        await asyncio.sleep(max(0.0, began + start_s + index * spacing - time.monotonic()))
        started = now_ms()
        try:
            touches_redis = await KINDS[kind](ctx, rng)
        except TimeoutError:  # not undone in its bound: the run goes on, the verdict says so
            done.append(Fault(kind, started, now_ms(), kind.startswith(("redis", "network")), undone=False))
            print(f"  fault {kind}: NOT undone within its bound ({(now_ms() - started) / 1000:.0f} s)", flush=True)
            continue
        done.append(Fault(kind, started, now_ms(), touches_redis))
        print(f"  fault {kind}: {(now_ms() - started) / 1000:.1f} s until undone", flush=True)
    return done
