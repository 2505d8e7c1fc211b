"""Admission and accounting of requests against a key's quotas, in Redis.

Three scripts (``lua/``), each loaded once and called by SHA, each one round
trip touching only the key's own hash-tagged keys:

- ``admit``: concurrency lease, requests/min, tokens/min reservation, daily and
  monthly token budgets, and the request record — all decided and written
  atomically, so concurrent requests cannot overshoot a limit.
- ``running``: the first token is out.
- ``settle``: real usage replaces the reservation, the lease is released,
  the record is final.

Limits use GCRA over 60 s (see admit.lua): a key with L/min may burst L at
once, then gets one more every 60/L s. Over any span of s seconds it is
admitted at most L + L*s/60.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources

from serve_app import redis_names
from serve_app.keys import KeyRecord

_SCRIPTS = resources.files("serve_app") / "lua"

# What 429 bodies say, by refusal kind: (OpenAI `type`, `code`).
REFUSALS = {
    "requests": ("requests", "rate_limit_exceeded"),
    "tokens": ("tokens", "rate_limit_exceeded"),
    "tokens_too_large": ("tokens", "rate_limit_exceeded"),
    "concurrency": ("concurrency", "rate_limit_exceeded"),
    "daily_budget": ("daily_token_budget", "insufficient_quota"),
    "monthly_budget": ("monthly_token_budget", "insufficient_quota"),
}


@dataclass(frozen=True)
class Decision:
    admitted: bool
    kind: str  # refusal kind; '' when admitted
    retry_ms: int  # -1: retrying cannot help (request larger than the limit)
    requests_remaining: int  # -1: unlimited
    requests_reset_ms: int
    tokens_remaining: int
    tokens_reset_ms: int
    detail: str

    def budget_used(self) -> dict[str, int]:
        """Tokens counted against each budget period, this request included
        (admitted requests of keys with a budget); ``{}`` otherwise."""
        if not self.admitted or not self.detail:
            return {}
        day, month = self.detail.split(",")
        return {"daily": int(day), "monthly": int(month)}

    def headers(self, key: KeyRecord) -> dict[str, str]:
        """OpenAI's rate-limit headers (plus retry-after on refusals)."""
        headers: dict[str, str] = {}
        if key.requests_per_minute:
            headers["x-ratelimit-limit-requests"] = str(key.requests_per_minute)
            headers["x-ratelimit-remaining-requests"] = str(max(self.requests_remaining, 0))
            headers["x-ratelimit-reset-requests"] = duration(self.requests_reset_ms)
        if key.tokens_per_minute:
            headers["x-ratelimit-limit-tokens"] = str(key.tokens_per_minute)
            headers["x-ratelimit-remaining-tokens"] = str(max(self.tokens_remaining, 0))
            headers["x-ratelimit-reset-tokens"] = duration(self.tokens_reset_ms)
        if not self.admitted and self.retry_ms >= 0:
            headers["retry-after"] = str(math.ceil(self.retry_ms / 1000))
            headers["retry-after-ms"] = str(self.retry_ms)
        return headers


def duration(ms: int) -> str:
    """OpenAI's reset format: ``20ms``, ``1.5s``, ``6m0s``."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s"


class Admission:
    def __init__(self, redis, *, lease_s: float, retention_s: int):
        self.redis = redis
        self.lease_ms = int(lease_s * 1000)
        self.retention_s = retention_s
        self._admit = redis.register_script((_SCRIPTS / "admit.lua").read_text())
        self._running = redis.register_script((_SCRIPTS / "running.lua").read_text())
        self._settle = redis.register_script((_SCRIPTS / "settle.lua").read_text())

    async def admit(
        self, key: KeyRecord, request_id: str, model: str, reserve_tokens: int, http_request_id: str = ""
    ) -> Decision:
        keys = redis_names.admission_keys(key.id, request_id)
        args = [
            request_id, model, key.requests_per_minute, key.tokens_per_minute,
            key.max_concurrent, key.daily_token_budget, key.monthly_token_budget,
            reserve_tokens, self.lease_ms, self.retention_s, key.id, http_request_id,
        ]
        if http_request_id:
            # Also index the HTTP x-request-id (Ray Serve's) so `requests show` finds
            # the record by it; outside the key's hash tag, so beside the script,
            # in the same round trip.
            async with self.redis.pipeline(transaction=False) as pipe:
                await self._admit(keys=keys, args=args, client=pipe)
                pipe.set(redis_names.http_request(http_request_id), request_id, ex=self.retention_s)
                reply, _ = await pipe.execute()
        else:
            reply = await self._admit(keys=keys, args=args)
        admitted, kind, retry, rr, rs, kr, ks, detail = reply
        return Decision(bool(admitted), _text(kind), int(retry), int(rr), int(rs), int(kr), int(ks), _text(detail))

    async def running(self, key_id: str, request_id: str, replica: str = "") -> None:
        await self._running(keys=redis_names.admission_keys(key_id, request_id), args=[replica])

    async def settle(
        self,
        key: KeyRecord,
        request_id: str,
        status: str,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        replica: str = "",
    ) -> int | None:
        """Final accounting; returns tokens charged beyond the reservation (or None
        if the request was already settled)."""
        return await self._settle(
            keys=redis_names.admission_keys(key.id, request_id),
            args=[request_id, status, prompt_tokens, completion_tokens, key.tokens_per_minute,
                  self.retention_s, replica],
        )


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
