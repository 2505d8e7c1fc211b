"""What the Redis path was like, seen from outside the gateway: a process of its
own PINGs every Redis node through its chaos proxy, each on its own thread every
100 ms, and keeps each moment the path answered slower than ``threshold_s`` or
not at all.

The gateway admits on local limits when a Redis call fails or times out
(``quota.fail_mode`` open), unless its own loop was a quarter of the timeout late
then (it sheds instead).
A slow Redis path is a Redis fault whether the harness injected it or not (a box
at load average 25 runs the proxies and Redis late too), so the ledger excuses
local admissions in these windows, for a short grace, and reports them; outside
every window, a local admission is the gateway's fault. Its threshold is half
``quota.redis_timeout_s``: a call waits on the loop at least twice, so one that timed
out while the loop ran less than a quarter late spent at least half on the path."""

from __future__ import annotations

import multiprocessing
import socket
import threading
import time
from multiprocessing.connection import Connection

from soak.ledger import Fault

EVERY_S = 0.1
# After a slow moment, how long the gateway may still act on it: a call begun in
# it times out at redis_timeout_s, and its fallback's admission is written then.
GRACE_MS = 5_000


class RedisPathProbe:
    def __init__(self, ports: list[int], threshold_s: float):
        spawn = multiprocessing.get_context("spawn")
        self._conn, child = spawn.Pipe()
        self._process = spawn.Process(target=_probe, args=(ports, threshold_s, child), name="redis-probe", daemon=True)

    def start(self) -> RedisPathProbe:
        self._process.start()
        return self

    def stop(self) -> list[Fault]:
        """The slow moments seen, merged where they touch: faults the ledger excuses."""
        try:
            self._conn.send("stop")
            spans = self._conn.recv() if self._conn.poll(30) else []
        finally:
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
        return [
            Fault("redis-slow (observed)", start, end, touches_redis=True, observed=True, grace_ms=GRACE_MS)
            for start, end in merged(spans)
        ]


def merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Spans one probe period apart or less are one moment (a node refusing every PING)."""
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1] + 2 * EVERY_S * 1000:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(start, end) for start, end in out]


def _probe(ports: list[int], threshold_s: float, conn: Connection) -> None:
    stopping = threading.Event()
    spans: list[tuple[int, int]] = []
    threads = [threading.Thread(target=_watch, args=(port, threshold_s, stopping, spans)) for port in ports]
    for thread in threads:
        thread.start()
    conn.recv()  # "stop"
    stopping.set()
    for thread in threads:
        thread.join(10)
    conn.send(list(spans))


def _watch(port: int, threshold_s: float, stopping: threading.Event, spans: list) -> None:
    sock: socket.socket | None = None
    while not stopping.wait(EVERY_S):
        began = time.time()
        try:
            if sock is None:
                sock = socket.create_connection(("127.0.0.1", port), timeout=4 * threshold_s)
            sock.sendall(b"PING\r\n")
            if not sock.recv(64).startswith(b"+PONG"):
                raise OSError("not a PONG")
            took = time.time() - began
        except OSError:  # refused, reset, timed out, a node loading or read-only: not answering
            took = None
            if sock is not None:
                sock.close()
                sock = None
        if took is None or took >= threshold_s:
            spans.append((int(began * 1000), int(time.time() * 1000)))
    if sock is not None:
        sock.close()
