"""Failed admin credentials, answered per client (docs/quotas.md, "Admins").

Guessing an admin credential is hopeless by their entropy, not by this throttle: a named
admin's secret is ``sk-admin-`` and 32 random bytes (256 bits), and the bootstrap
``admin_token`` is refused at start when shorter than 32 characters (`openssl rand -hex
32`: 256 bits). So a correct credential is always checked and always passes: a
throttle that refused it would let anyone sharing the admin's address (every client
behind a load balancer or a NAT) keep every operator out with a few wrong guesses.

What the throttle does: an admin credential that fails (the admin API, the console's
login) counts against the client that sent it, in Redis so that every ingress replica
counts together; past ``auth.admin_failures_per_minute`` in a clock minute, that
client's failures are a 429 with ``retry-after`` instead of a 401, telling a script
to stop. Only a presented credential of an admin's shape counts: none is a 401, and a
tenant's API key or identity token is refused without counting.

The client is the ``X-Forwarded-For`` entry the first proxy not in ``auth.trusted_proxies``
added: the edge appends the address it was reached from (``option forwardfor``:
cluster/haproxy_edge.py), so with no trusted proxies it is the edge's peer, and behind
a load balancer listed there the address the balancer saw. Entries a client wrote
itself are never read past that. Without one (a replica's port reached directly), all
such clients share one count. The count's name holds a digest of the address, not the
address, and lives two minutes."""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Sequence
from ipaddress import IPv4Network, IPv6Network, ip_address, ip_network

from redis.exceptions import RedisClusterException, RedisError

from serve_app.errors import OpenAIError
from serve_app.redis_store import redis_names

logger = logging.getLogger("ray.serve")

WINDOW_S = 60
# Redis refused or did not answer: the guard gives way (a named admin's credential is
# not checked without Redis anyway; the bootstrap token is).
REDIS_FAILED = (RedisError, RedisClusterException, OSError, TimeoutError)


def client_of(headers, trusted: Sequence[IPv4Network | IPv6Network] = ()) -> str:
    """The client's address: the rightmost X-Forwarded-For entry not added by a trusted
    proxy (the edge's own is the last; a trusted load balancer's the one before it)."""
    forwarded = (
        headers.getlist("x-forwarded-for") if hasattr(headers, "getlist") else [headers.get("x-forwarded-for") or ""]
    )
    entries = [entry.strip() for value in forwarded for entry in value.split(",") if entry.strip()]
    while len(entries) > 1 and _is_trusted(entries[-1], trusted):
        entries.pop()
    return entries[-1] if entries else "unknown"


def _is_trusted(address: str, trusted: Sequence[IPv4Network | IPv6Network]) -> bool:
    try:
        ip = ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in trusted)


class CredentialGuard:
    def __init__(self, redis, failures_per_minute: int, trusted_proxies: Sequence[str] = ()):
        self.redis, self.limit = redis, failures_per_minute
        self.trusted = tuple(ip_network(network) for network in trusted_proxies)

    def client(self, headers) -> str:
        """The address a request came from (``client_of`` with the configured proxies)."""
        return client_of(headers, self.trusted)

    def _count_name(self, headers) -> tuple[str, float]:
        now = time.time()
        digest = hashlib.sha256(self.client(headers).encode()).hexdigest()[:16]
        return redis_names.admin_failures(digest, int(now // WINDOW_S)), now

    async def failed(self, headers) -> None:
        """Count a failed credential of this client; a 429 once it failed past the limit
        this minute (Redis unreachable: counted nowhere, the caller's 401 stands)."""
        if self.limit <= 0:
            return
        name, now = self._count_name(headers)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.incr(name)
                pipe.expire(name, 2 * WINDOW_S)
                failures, _ = await pipe.execute()
        except REDIS_FAILED as exc:
            logger.warning("a failed admin credential could not be counted: %r", exc)
            return
        if failures > self.limit:
            wait_s = max(1, math.ceil(WINDOW_S - now % WINDOW_S))
            raise OpenAIError(
                429,
                f"Too many failed admin credentials from this client ({failures} this minute). Try again in {wait_s}s.",
                type="requests",
                code="rate_limit_exceeded",
                headers={"retry-after": str(wait_s), "retry-after-ms": str(wait_s * 1000)},
            )
