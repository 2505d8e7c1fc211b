"""Admission's seam: what the request path (the gateway, the relay, the routes and the
batch runner) sees of admission, and all it imports of it. ``Admitter`` is the one
interface; an admitted request is a ``Ticket``; a refusal is a ``Refusal`` (of a
``REFUSALS`` kind, with Redis' ``Decision`` when Redis decided), rendered by
serve_app/pipeline/refusals.py. The implementation is serve_app/admission/gatekeeper.py
(wired by serve_app/http/services.py), over the Redis scripts (scripts.py), which
nothing else of the product imports (tests/unit/test_boundaries.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from contract.replica_wire import Usage
from serve_app.accounting.costs import NANOS_PER_USD, Rates
from serve_app.identity.keys import KeyRecord
from serve_app.identity.teams import TeamRecord

# What 429 bodies say, by refusal kind: (OpenAI `type`, `code`).
REFUSALS = {
    "requests": ("requests", "rate_limit_exceeded"),
    "tokens": ("tokens", "rate_limit_exceeded"),
    "tokens_too_large": ("tokens", "rate_limit_exceeded"),
    "concurrency": ("concurrency", "rate_limit_exceeded"),
    "daily_budget": ("daily_token_budget", "insufficient_quota"),
    "monthly_budget": ("monthly_token_budget", "insufficient_quota"),
    "daily_cost_budget": ("daily_cost_budget", "insufficient_quota"),
    "monthly_cost_budget": ("monthly_cost_budget", "insufficient_quota"),
    # Not a limit: the key or team is disabled or gone in Redis (admit.lua reads its
    # record), though the replica's cached record said otherwise. Answered as a 401.
    "revoked": ("authentication_error", "invalid_api_key"),
}


@dataclass(frozen=True)
class Decision:
    admitted: bool
    kind: str  # refusal kind; '' when admitted ('again': under an admission its id already held)
    retry_ms: int  # -1: retrying cannot help (request larger than the limit)
    requests_remaining: int  # -1: unlimited
    requests_reset_ms: int
    tokens_remaining: int
    tokens_reset_ms: int
    detail: str
    # The limits Redis applied, read from the account's stored record in the same
    # script: "rpm,tpm,concurrent,daily,monthly,daily nanos,monthly nanos"; "" when
    # the caller's were applied (an identity-token user).
    applied: str = ""

    def as_applied(self, key: KeyRecord) -> KeyRecord:
        """``key`` with the limits this decision applied (what its 429 and headers name:
        a replica's cached record may predate a change)."""
        if not self.applied:
            return key
        rpm, tpm, concurrent, daily, monthly, daily_nanos, monthly_nanos = map(int, self.applied.split(","))
        return key.model_copy(
            update={
                "requests_per_minute": rpm,
                "tokens_per_minute": tpm,
                "max_concurrent": concurrent,
                "daily_token_budget": daily,
                "monthly_token_budget": monthly,
                "daily_cost_budget_usd": daily_nanos / NANOS_PER_USD,
                "monthly_cost_budget_usd": monthly_nanos / NANOS_PER_USD,
            }
        )

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
        rpm, tpm = key.requests_per_minute, key.tokens_per_minute
        if self.applied:  # as Redis applied them (no copy of the record on the hot path)
            rpm, tpm = map(int, self.applied.split(",", 2)[:2])
        if rpm:
            headers["x-ratelimit-limit-requests"] = str(rpm)
            headers["x-ratelimit-remaining-requests"] = str(max(self.requests_remaining, 0))
            headers["x-ratelimit-reset-requests"] = duration(self.requests_reset_ms)
        if tpm:
            headers["x-ratelimit-limit-tokens"] = str(tpm)
            headers["x-ratelimit-remaining-tokens"] = str(max(self.tokens_remaining, 0))
            headers["x-ratelimit-reset-tokens"] = duration(self.tokens_reset_ms)
        if not self.admitted and self.retry_ms >= 0:
            headers["retry-after"] = str(math.ceil(self.retry_ms / 1000))
            headers["retry-after-ms"] = str(self.retry_ms)
        return headers


@dataclass(frozen=True)
class Refusal:
    """Admission said no: which limit (a ``REFUSALS`` kind) of which level refused, as
    a value the caller renders (serve_app/pipeline/refusals.py). ``key`` is the
    level that refused: the API key, or its team (``level`` "team", a TeamRecord).
    ``decision`` is Redis' (the headers are its own); None when the local limits of
    an outage decided, which know only when to retry (``retry_s``)."""

    key: KeyRecord
    kind: str
    reserved: int  # the tokens the request asked to reserve
    decision: Decision | None = None
    retry_s: float = 0.0
    level: str = "key"  # key | team
    reserved_nanos: int = 0  # its reserved cost (money budgets)

    @property
    def headers(self) -> dict[str, str]:
        headers = self.decision.headers(self.key) if self.decision is not None else {}
        return {**headers, "x-ratelimit-scope": self.level}


def duration(ms: int) -> str:
    """OpenAI's reset format: ``20ms``, ``1.5s``, ``6m0s``."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s"


@dataclass(frozen=True)
class LocalOrigin:
    """What the record of a request admitted without Redis keeps of its admission:
    Redis never saw it, so its settlement writes them (settle.lua)."""

    http_request_id: str
    admitted_ms: int


@dataclass
class Ticket:
    """An admitted request: what settling it needs, and its response headers."""

    key: KeyRecord
    request_id: str
    model: str
    headers: dict[str, str] = field(default_factory=dict)
    local: bool = False  # admitted by the local fallback, not by Redis
    origin: LocalOrigin | None = None  # when local: what its record keeps of the admission
    settled: bool = False
    # Called once when it is settled, whatever the outcome (the gateway frees the
    # request's fair-share place with it: every path ends in exactly one settlement).
    on_settle: Callable[[], None] | None = None
    # Set when its key is revoked or disabled while it runs: a stream's relay then
    # ends it at its next item, settled as what it delivered.
    revoked: bool = False
    # Called once when it is marked revoked (a unary call cancels itself with it).
    on_revoke: Callable[[], None] | None = None
    # Its model's prices for it (set by the gateway once admitted; None: not priced)
    # and its reservation as (prompt, completion) tokens, which price an unknown usage.
    rates: Rates | None = None
    reserved: tuple[int, int] = (0, 0)
    # The key's team when it has one: admitted, renewed and settled beside the key.
    team: TeamRecord | None = None
    # Its request's trace (serve_app/tracing.py; set by the gateway): settling it is a stage.
    trace: Any = None
    # What failed over on its way, as its record keeps it ('failover'): each replica that
    # failed it before its first byte ('<replica>:<why>'), the model it fell back from.
    failover: list[str] = field(default_factory=list)

    def levels(self) -> list[KeyRecord]:
        """The records it was admitted against: its key, and its team."""
        return [self.key] if self.team is None else [self.key, self.team]


class EdgeAdmissionSettled(Exception):
    """The id the edge gave an admission (``Admitter.admit``'s ``given_id``) is settled
    already: the request's earlier try held it, died, and the reaper finalised it
    (``abandoned``, charged its reservation) before this try came. Nothing was admitted
    or charged by this call; the caller tries the edge's next id (Gateway ``_edge_id``),
    admitted as a new request."""


class Admitter(Protocol):
    """Admission as the request path uses it (the Gatekeeper is the one implementation)."""

    default_max_tokens: int

    async def team_of(self, key: KeyRecord, model: str) -> TeamRecord | None: ...

    def may_start_before_admission(self, key: KeyRecord, reserve_tokens: int) -> bool: ...

    def overloaded(self) -> bool: ...

    async def admit(
        self,
        key: KeyRecord,
        model: str,
        reserve_tokens: int,
        http_request_id: str = "",
        request_id: str | None = None,
        reserve_nanos: int = 0,
        request_paid: bool = False,
        given_id: str | None = None,
    ) -> Ticket | Refusal: ...

    async def withdraw(self, ticket: Ticket, keep_request: bool = False) -> None: ...

    async def refusal_before_body(self, key: KeyRecord) -> Refusal | None: ...

    def running(self, ticket: Ticket, replica: str = "") -> None: ...

    def settle(self, ticket: Ticket, status: str, usage: Usage | None = None, replica: str = "") -> None: ...
