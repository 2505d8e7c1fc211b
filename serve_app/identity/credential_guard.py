"""Failed admin credentials, throttled per client (docs/quotas.md, "Admins").

An admin credential that fails (the admin API, the console's login) counts against
the client that sent it, in Redis so that every ingress replica counts together;
past ``auth.admin_failures_per_minute`` in a clock minute, that client's admin
credentials are not even checked until the minute ends: a 429 with ``retry-after``.
Only a presented credential counts (a request with none is a 401 and guesses
nothing), and a credential is refused unchecked while throttled, so a guess that
would be right gains nothing either.

The client is the last ``X-Forwarded-For`` the edge added (``option forwardfor``:
cluster/haproxy_edge.py), after any a client sent; without one (a replica's port
reached directly), all such clients share one count. The count's name holds a
digest of the address, not the address, and lives two minutes."""

from __future__ import annotations

import hashlib
import logging
import math
import time

from redis.exceptions import RedisClusterException, RedisError

from serve_app.errors import OpenAIError
from serve_app.redis_store import redis_names

logger = logging.getLogger("ray.serve")

WINDOW_S = 60
# Redis refused or did not answer: the guard gives way (a named admin's credential is
# not checked without Redis anyway; the bootstrap token is).
REDIS_FAILED = (RedisError, RedisClusterException, OSError, TimeoutError)


def client_of(headers) -> str:
    """The client's address as the edge saw it: the last X-Forwarded-For entry."""
    forwarded = (
        headers.getlist("x-forwarded-for") if hasattr(headers, "getlist") else [headers.get("x-forwarded-for") or ""]
    )
    last = (forwarded[-1] if forwarded else "").rpartition(",")[2].strip()
    return last or "unknown"


class CredentialGuard:
    def __init__(self, redis, failures_per_minute: int):
        self.redis, self.limit = redis, failures_per_minute

    def _count_name(self, headers) -> tuple[str, float]:
        now = time.time()
        digest = hashlib.sha256(client_of(headers).encode()).hexdigest()[:16]
        return redis_names.admin_failures(digest, int(now // WINDOW_S)), now

    async def check(self, headers) -> None:
        """A 429 when this client failed too often this minute (Redis unreachable: no check)."""
        if self.limit <= 0:
            return
        name, now = self._count_name(headers)
        try:
            failures = int(await self.redis.get(name) or 0)
        except REDIS_FAILED:
            return
        if failures >= self.limit:
            wait_s = max(1, math.ceil(WINDOW_S - now % WINDOW_S))
            raise OpenAIError(
                429,
                f"Too many failed admin credentials from this client ({failures} this minute). Try again in {wait_s}s.",
                type="requests",
                code="rate_limit_exceeded",
                headers={"retry-after": str(wait_s), "retry-after-ms": str(wait_s * 1000)},
            )

    async def failed(self, headers) -> None:
        """Count a failed credential of this client."""
        if self.limit <= 0:
            return
        name, _ = self._count_name(headers)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.incr(name)
                pipe.expire(name, 2 * WINDOW_S)
                await pipe.execute()
        except REDIS_FAILED as exc:
            logger.warning("a failed admin credential could not be counted: %r", exc)
