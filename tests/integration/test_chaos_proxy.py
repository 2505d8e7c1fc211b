"""The soak's chaos proxy (soak/chaos_proxy.py), a process of its own, does to a
real Redis connection what each fault says: passes it through, delays it, cuts
it with a reset, refuses new ones, and stops leaving no process behind."""

from __future__ import annotations

import time

import pytest
import redis

from soak.chaos_proxy import ChaosProxy
from soak.redis_probe import RedisPathProbe
from soak.topology import free_port


@pytest.fixture
def proxy(redis_server):
    proxy = ChaosProxy(free_port(), redis_server.port).start()
    yield proxy
    proxy.stop()
    assert not proxy._process.is_alive()


def test_the_proxy_passes_delays_cuts_and_refuses_on_command(proxy):
    client = redis.Redis(port=proxy.listen_port, socket_timeout=5)
    assert client.ping()
    proxy.latency_s = 0.3
    began = time.monotonic()
    assert client.ping()
    assert time.monotonic() - began >= 0.6  # each way
    proxy.latency_s = 0.0
    assert proxy.reset() == 2  # the client's connection and the proxy's own to Redis
    proxy.refuse = True
    with pytest.raises(redis.ConnectionError):
        client.ping()  # its connection was cut, and a new one is refused
    proxy.refuse = False
    assert client.ping()


def test_the_probe_sees_the_moments_the_path_was_slow_and_only_those(proxy):
    """soak/redis_probe.py: what the ledger excuses a local admission by."""
    probe = RedisPathProbe([proxy.listen_port], threshold_s=0.25).start()
    time.sleep(1.5)  # a clean path: nothing seen
    began = int(time.time() * 1000)
    proxy.latency_s = 0.2  # 0.4 s a PING, each way delayed
    time.sleep(1.5)
    proxy.latency_s = 0.0
    ended = int(time.time() * 1000)
    time.sleep(1.0)
    seen = probe.stop()
    assert seen and all(fault.observed and fault.touches_redis for fault in seen)
    assert all(began - 100 <= fault.started_ms and fault.healed_ms <= ended + 600 for fault in seen)
    # Most of the 1.5 s: each end of it may miss up to one PING in flight (0.4 s slow)
    # and one probe period (0.1 s); seen 903 ms once, beside the unit tests.
    assert sum(fault.healed_ms - fault.started_ms for fault in seen) >= 1500 - 2 * (400 + 100)
