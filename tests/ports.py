"""Ports for the servers tests and benchmarks start (Redis, a stack's HTTP port,
Prometheus, a vLLM target).

Not ``bind(0)``: that hands out a port from the kernel's ephemeral range and frees
it, and until our server binds it, any other ``bind(0)`` may get the same port. A
stack's own processes do exactly that (each Ray Serve replica's gRPC server): a
chaos run's `llmctl run` once polled its HTTP port and got a replica's HTTP/2
SETTINGS frame back. So the ports come from below the ephemeral range and above
Ray's worker ports (10002-19999), where nothing binds unasked, and none is handed
out twice by one process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

from serve_app.ops.local_stack import port_in_use

LOWEST = 20000  # above Ray's default worker ports (10002-19999)
_given: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    low, _ = ephemeral_range()
    candidates = list(range(LOWEST, low))
    random.shuffle(candidates)
    for port in candidates:
        if port not in _given and not port_in_use("0.0.0.0", port):
            _given.add(port)
            return port
    # No room below the ephemeral range on this machine: the kernel's pick, as before.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
