"""Who may send a request, whether it is admitted now, and what it cost.

One ``Access`` per ingress replica wraps the key store and the admission
scripts with what the hot path needs: a short key cache (a revoked key stops
working within ``key_cache_ttl_s``), admission that answers a ``Ticket`` or a
``Refusal`` (its caller words it: serve_app/pipeline/refusals.py), fire-and-forget
bookkeeping that never delays a response, and the Redis-down behaviour that
``fail_mode`` chooses.

Redis failures are told apart (docs/quotas.md, "Keys and quotas"):
- unreachable (connection refused or lost, timeout; a Redis Cluster with a slot
  between primaries, CLUSTERDOWN or TRYAGAIN, once the client's own retries
  are spent): ``fail_mode`` decides, and
  every request the ingress decided without Redis is settled through Redis
  once it answers again. A timed-out call may still have run, and settling is
  idempotent, so nothing that call wrote outlives the request.
- any other error (a script error, OOM, READONLY after a failover, MOVED):
  Redis answered and refused to work, so the request gets 503
  ``quota_backend_error``; it is never admitted without its quota.

A background loop per ingress (``maintain``) renews the concurrency leases of
its running requests and retries settlements Redis missed.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ClusterDownError, RedisClusterException, RedisError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from contract.replica_wire import Usage
from serve_app.errors import OpenAIError, quota_store_error, quota_store_unavailable, records_backlog
from serve_app.redis_store import redis_client
from serve_app.admission.scripts import Admission, Decision, Refusal
from serve_app.identity.admins import SECRET_PREFIX as ADMIN_SECRET_PREFIX
from serve_app.identity.admins import AdminStore
from serve_app.accounting.audit import ADMIN_TOKEN_ACTOR, AuditLog
from serve_app.accounting.costs import Cost, Rates
from serve_app.identity.credential_guard import CredentialGuard
from serve_app.identity.jwt_auth import JwtAuthenticator, is_jwt_identity, looks_like_jwt
from serve_app.identity.key_cache import KeyCache
from serve_app.identity.keys import KeyRecord, KeyStore, digest
from serve_app.admission.local_limits import LocalLimiter
from serve_app.admission.overlap import OverlapGuard
from serve_app.accounting.record_shipper import RecordShipper
from serve_app.accounting.record_sink import RecordSink
from serve_app.identity.teams import TeamNotFound, TeamRecord, TeamStore, is_team_id
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry
from serve_app.tracing import now_ns
from serve_app.accounting.usage import new_request_id

logger = logging.getLogger("ray.serve")

# Settlements waiting for Redis to answer again: beyond this many, the oldest is
# dropped (its lease then expires and the next admission of its key reaps it).
MAX_UNSETTLED = 10_000
MAINTENANCE_TICK_S = 1.0
REPLICA_COUNT_REFRESH_S = 10.0

# Redis did not answer (it may still run what was sent): fail_mode applies.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError,
               ClusterDownError, TryAgainError, SlotNotCoveredError)
# Anything the client raises about Redis (the cluster client's own errors are not RedisError).
REDIS_FAILED = (RedisError, RedisClusterException)


@dataclass
class Ticket:
    """An admitted request: what settling it needs, and its response headers."""

    key: KeyRecord
    request_id: str
    model: str
    headers: dict[str, str] = field(default_factory=dict)
    local: bool = False  # admitted by the local fallback, not by Redis
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

    def levels(self) -> list[KeyRecord]:
        """The records it was admitted against: its key, and its team."""
        return [self.key] if self.team is None else [self.key, self.team]


class Access:
    def __init__(self, settings: AppSettings, telemetry: Telemetry, deployment: dict | None = None):
        """``deployment``: the Serve options of the deployment this runs in, whose
        replicas share a key's limits during a Redis outage (the ingress' unless
        given: a model's direct route passes its own)."""
        self.telemetry = telemetry
        quota = settings.quota
        self.redis = redis_client.connect(settings.redis_url, timeout_s=quota.redis_timeout_s)
        self.keys = KeyStore(self.redis)
        self.teams = TeamStore(self.redis)
        self.audit = AuditLog(self.redis)  # admin actions (admin/operations.py writes it)
        self.admins = AdminStore(self.redis)  # named admin credentials
        self.credential_guard = CredentialGuard(self.redis, settings.auth.admin_failures_per_minute)
        # Tokens of the company's identity provider, besides API keys (jwt_auth.py).
        self.jwt = JwtAuthenticator(settings.auth.jwt) if settings.auth.jwt is not None else None
        # Final records to the record sink (record_shipper.py); Redis keeps them recent_s.
        records = settings.records
        self.records = (RecordShipper(self.redis, RecordSink(records.sink_dir, quota.request_retention_s),
                                      records.max_backlog, telemetry)
                        if records.sink_dir else None)
        self.admission = Admission(
            self.redis, lease_s=quota.concurrency_lease_s, retention_s=quota.request_retention_s,
            settled_s=records.recent_s if self.records is not None else None,
            replicas_to_acknowledge=quota.replicas_to_acknowledge, acknowledge_timeout_ms=quota.replica_ack_timeout_ms,
        )
        self.fail_open = quota.fail_mode == "open"
        self.default_max_tokens = quota.default_max_tokens
        # Which keys' streams may start before their admission returns (overlap.py).
        self.overlap = OverlapGuard() if quota.overlap_admission else None
        self.renew_every_s = quota.concurrency_lease_s / 3
        self.ingress_replicas = IngressReplicas(settings.ingress.deployment if deployment is None else deployment)
        self.local = LocalLimiter(self.ingress_replicas.count)
        self.admin_token = settings.admin_token.get_secret_value() if settings.admin_token else None
        self._cache = KeyCache(quota.key_cache_ttl_s, quota.key_stale_max_s, quota.key_cache_max)
        # Team records by id (or an identity token's team name), cached as key records are:
        # a disabled team stops its keys as fast as a revoked key stops.
        self._team_cache = KeyCache(quota.key_cache_ttl_s, quota.key_stale_max_s, quota.key_cache_max)
        # How often the keys of running requests are read again (a revoked key's streams stop).
        self.revocation_check_s = max(quota.key_cache_ttl_s, MAINTENANCE_TICK_S)
        self._background: set[asyncio.Task] = set()
        # Requests admitted through Redis and not settled yet: their leases are renewed.
        self._leased: dict[str, Ticket] = {}
        # request id -> Admission.settle arguments, for settlements Redis has not taken yet.
        self._unsettled: dict[str, tuple] = {}
        self._maintainer: asyncio.Task | None = None

    # -- authentication ------------------------------------------------------

    async def authenticate(self, headers, seen: dict[str, str] | None = None) -> KeyRecord:
        """The caller's key record, or a 401/503. ``seen["source"]`` says where it came
        from (a trace's attribute): ``cache``, ``redis``, ``stale_cache`` (Redis
        unreachable) or ``identity_token``."""
        seen = {} if seen is None else seen
        secret = _secret_from(headers)
        if not secret:
            raise OpenAIError(
                401,
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>', 'api-key: <key>' or 'x-api-key: <key>'.",
                code="invalid_api_key",
            )
        if self.jwt is not None and looks_like_jwt(secret):
            seen["source"] = "identity_token"
            return await self.jwt.authenticate(secret)  # checked in memory: no Redis, no cache
        hashed = digest(secret)
        hit, record = self._cache.get(hashed)
        seen["source"] = "cache"
        if not hit:
            seen["source"] = "redis"
            try:
                record = await self.keys.authenticate(secret)
            except UNREACHABLE as exc:
                self.telemetry.redis_failed("authenticate")
                record = self._fallback(hashed, exc)
                seen["source"] = "stale_cache"
            except REDIS_FAILED as exc:
                self.telemetry.redis_failed("authenticate")
                logger.error("Redis refused to look a key up: %r", exc)
                raise quota_store_error() from None
            else:
                self._cache.put(hashed, record)
        if record is None:
            raise OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return record

    async def tenant(self, headers) -> KeyRecord:
        """The caller's key as a route that names models sees it: a 401 for a revoked
        key or a disabled team (``team_of``), and its models narrowed to those its
        team allows too, so a listing, a card or a dialect's default model never
        names one it may not use."""
        key = await self.authenticate(headers)
        team = await self.team_of(key)
        if team is None or team.models is None:
            return key
        allowed = [model for model in team.models if key.allows_model(model)]
        return key.model_copy(update={"models": allowed})

    def _fallback(self, hashed: str, exc: Exception) -> KeyRecord:
        """A key record to stand in while Redis is unreachable (fail_mode open):
        one Redis confirmed within ``key_stale_max_s``, or a 503."""
        record = self._cache.fallback(hashed) if self.fail_open else None
        if record is None:
            raise quota_store_unavailable()
        logger.warning("Redis unreachable (%s): using the cached key record", type(exc).__name__)
        self.telemetry.fell_back("cached_key")
        return record

    async def admin_actor(self, headers) -> str:
        """Who is calling the admin API (the audit trail's actor: ``admin-token`` for
        the shared bootstrap token, ``admin:<name>`` for a named credential), or 401."""
        secret = _secret_from(headers)
        if secret:  # a client past its failed credentials of the minute is not even checked
            await self.credential_guard.check(headers)
        # As bytes: compare_digest refuses str with non-ASCII characters (a header may carry any).
        if self.admin_token is not None and secret and hmac.compare_digest(
            secret.encode("utf-8", "surrogateescape"), self.admin_token.encode("utf-8")
        ):
            return ADMIN_TOKEN_ACTOR
        admin = None
        if secret and secret.startswith(ADMIN_SECRET_PREFIX):
            try:
                admin = await self.admins.authenticate(secret)
            except UNREACHABLE:
                self.telemetry.redis_failed("authenticate")
                raise quota_store_unavailable() from None
            except REDIS_FAILED:
                self.telemetry.redis_failed("authenticate")
                raise quota_store_error() from None
        if admin is None:
            if secret:
                await self.credential_guard.failed(headers)
            raise OpenAIError(401, "Admin API: invalid or missing admin credential.", code="invalid_api_key")
        return f"admin:{admin.name}"

    @staticmethod
    def authorize(key: KeyRecord, model: str) -> None:
        if not key.allows_model(model):
            raise OpenAIError(
                403, f"This API key may not use model '{model}'.", param="model", code="model_not_allowed"
            )

    # -- admission -------------------------------------------------------------

    def may_start_before_admission(self, key: KeyRecord, reserve_tokens: int) -> bool:
        """Whether a stream of ``key`` may go to the engine while its admission is
        in Redis (serve_app/admission/overlap.py); if so, the room it assumes is spent."""
        return self.overlap is not None and self.overlap.try_spend(key, reserve_tokens)

    async def admit(self, key: KeyRecord, model: str, reserve_tokens: int, http_request_id: str = "",
                    request_id: str | None = None, reserve_nanos: int = 0) -> Ticket | Refusal:
        """A ``Ticket`` to run, or the ``Refusal`` of a limit of the key or of its team
        (rendered by the caller). A quota store that cannot decide raises its 503.
        ``request_id``: the id the request was already sent to the engine under (an
        overlapped admission); a new one otherwise. ``reserve_nanos``: the cost of
        the reservation, held against the money budgets."""
        if self.records is not None and self.records.backlogged:
            raise records_backlog()  # back-pressure: the sink is down, Redis holds its bound of records
        request_id = request_id or new_request_id(key.id)
        team = await self.team_of(key, model)
        levels = [key] if team is None else [key, team]
        started = time.perf_counter()
        try:
            # Level by level, the key first, each on its own slot, stopping at the first
            # that refuses; the levels that admitted it are then taken back (below). So a
            # team's room is only ever held by requests their key admitted: sent at once,
            # keys over their own limit would hold the team's places while their
            # admissions were taken back, and refuse requests that fit (measured: 1 of 20
            # admitted where 7 fit). The price: a round trip per level.
            decisions = []
            for level in levels:
                decisions.append(await self.admission.admit(
                    level, request_id, model, reserve_tokens, http_request_id if level is key else "",
                    reserve_nanos, team.id if team is not None and level is key else ""))
                if not decisions[-1].admitted:
                    break
        except asyncio.CancelledError:
            # The client left while its admission was on the wire: the call still
            # runs in Redis (auto_pipeline), so the id is settled, which frees a
            # lease it took or makes a later admit of it change nothing.
            for level in levels:
                self._settle_later(level, request_id, model, "cancelled", 0, 0)
            raise
        except UNREACHABLE as exc:
            self.telemetry.redis_failed("admit")
            self._no_overlap(key)  # no guesses while Redis cannot answer
            try:
                admitted = self._admit_locally(key, request_id, model, reserve_tokens, exc)
            except OpenAIError:
                for level in levels:
                    self._settle_later(level, request_id, model, "failed", 0, 0)  # in case the call ran
                raise
            if isinstance(admitted, Refusal):
                for level in levels:
                    self._settle_later(level, request_id, model, "failed", 0, 0)
            else:
                admitted.team = team  # the team's share is not kept locally: settled through Redis later
            return admitted
        except REDIS_FAILED as exc:
            self.telemetry.redis_failed("admit")
            self._no_overlap(key)
            logger.error("Redis refused the admission script: %s", exc)
            for level in levels:
                self._settle_later(level, request_id, model, "failed", 0, 0)  # undo what a failed script wrote
            raise quota_store_error() from None
        self.telemetry.admission_took(time.perf_counter() - started)
        decision, last = decisions[0], decisions[-1]
        self._record_budget_use(key, decision)
        if last.kind == "duplicate":  # its id settled before this admission ran: never while we wait on it
            raise quota_store_error()
        if not last.admitted:  # the level that refused is the last one asked
            self._no_overlap(key)
            if len(decisions) > 1:  # the team: the key's admission is taken back
                await self._release(levels[0], request_id, model, "team_" + last.kind)
            if team is not None:
                self.telemetry.team_refused(team.name, "key" if len(decisions) == 1 else "team")
            return Refusal(last.as_applied(levels[len(decisions) - 1]), last.kind, reserve_tokens, last,
                           level="key" if len(decisions) == 1 else "team", reserved_nanos=reserve_nanos)
        if self.overlap is not None:
            self.overlap.admitted(key, decision)
        ticket = Ticket(key, request_id, model, decision.headers(key), team=team)
        self._leased[request_id] = ticket
        if http_request_id:
            self._spawn(self.admission.index_http_id(http_request_id, request_id))
        return ticket

    async def withdraw(self, ticket: Ticket) -> None:
        """Take a ticket's admission back as if it never happened, at every level: its
        request ran nothing and is admitted again (a prompt the replica counted larger
        than its reservation: serve_app/pipeline/gateway.py), so neither its request of
        requests/min nor its reservation may count twice. Not a refusal either. A ticket
        admitted without Redis is settled as failed instead (its local share)."""
        if ticket.settled:
            return
        if ticket.local:
            self.settle(ticket, "failed", Usage())
            return
        ticket.settled = True
        if ticket.on_settle is not None:
            ticket.on_settle()
        if self._leased.pop(ticket.request_id, None) is not None and self.overlap is not None:
            self.overlap.ended(ticket.key.id)
        for level in ticket.levels():
            await self._release(level, ticket.request_id, ticket.model, "")

    async def _release(self, level: KeyRecord, request_id: str, model: str, refused_by: str) -> None:
        """Take back a level's admission of a request another level refused. If Redis
        does not take it now, it is settled as failed later (its reservation given
        back; its request stays counted)."""
        try:
            await self.admission.release(level, request_id, refused_by)
        except REDIS_FAILED:
            self.telemetry.redis_failed("admit")
            self._settle_later(level, request_id, model, "failed", 0, 0)

    async def team_of(self, key: KeyRecord, model: str = "") -> TeamRecord | None:
        """The key's team as admission applies it (cached for ``key_cache_ttl_s``), or
        None for a key without one. A team disabled or gone refuses its keys (401);
        a model the team may not use, 403. While Redis is unreachable, a record it
        confirmed within ``key_stale_max_s`` stands in (fail_mode open), or a 503."""
        if key.team is None:
            return None
        hit, team = self._team_cache.get(key.team)
        if not hit:
            try:
                # By id (a key's), or by name (an identity token's team claim, jwt_auth.py).
                team = await self.teams.resolve(key.team)
            except TeamNotFound:
                team = None
            except UNREACHABLE:
                self.telemetry.redis_failed("authenticate")
                team = self._team_cache.fallback(key.team) if self.fail_open else None
                if team is None:
                    raise quota_store_unavailable() from None
            except REDIS_FAILED:
                self.telemetry.redis_failed("authenticate")
                raise quota_store_error() from None
            else:
                self._team_cache.put(key.team, team)
        if team is None or not team.enabled:
            raise OpenAIError(401, f"The team of API key '{key.name}' is disabled or does not exist.",
                              code="team_disabled")
        if model and not team.allows_model(model):
            raise OpenAIError(403, f"The team '{team.name}' of this API key may not use model '{model}'.",
                              param="model", code="model_not_allowed")
        return team

    def _no_overlap(self, key: KeyRecord) -> None:
        if self.overlap is not None:
            self.overlap.refused(key)

    def _record_budget_use(self, key: KeyRecord, decision: Decision) -> None:
        budgets = {"daily": key.daily_token_budget, "monthly": key.monthly_token_budget}
        used = decision.budget_used()
        if decision.kind in ("daily_budget", "monthly_budget"):  # refused: detail = that period's use
            used = {decision.kind.split("_")[0]: int(decision.detail)}
        for period, tokens in used.items():
            self.telemetry.budget_used(key.name, period, tokens, budgets[period])

    def _admit_locally(self, key: KeyRecord, request_id: str, model: str, reserve_tokens: int,
                       exc) -> Ticket | Refusal:
        if not self.fail_open:
            raise quota_store_unavailable()
        self.telemetry.fell_back("local_limits")
        logger.warning("Redis unreachable (%s): admitting on local limits", type(exc).__name__)
        admitted, kind, retry_s = self.local.admit(key, request_id, reserve_tokens)
        if not admitted:
            return Refusal(key, kind, reserve_tokens, retry_s=retry_s)
        return Ticket(key, request_id, model, {}, local=True)

    # -- bookkeeping off the response path ------------------------------------

    def running(self, ticket: Ticket, replica: str = "") -> None:
        if not ticket.local:
            self._spawn(self.admission.running(ticket.key.id, ticket.request_id, replica))

    def settle(self, ticket: Ticket, status: str, usage: Usage | None = None, replica: str = "") -> None:
        """``usage`` None keeps the whole reservation charged (e.g. a stream the
        client cancelled: tokens were made but never counted). Once per ticket."""
        if ticket.settled:
            return
        ticket.settled = True
        if ticket.on_settle is not None:
            ticket.on_settle()
        prompt = completion = -1
        cached = 0
        if usage is not None:
            prompt, completion, cached = usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens
        cost = Cost.of(ticket.rates, prompt, completion, *ticket.reserved, cached_prompt=cached)
        if ticket.team is not None:
            reserved = sum(ticket.reserved) if prompt < 0 else 0
            self.telemetry.team_charged(ticket.team.name, max(prompt, 0), max(completion, 0), reserved, cost.nanos)
        if ticket.local:
            self.local.release(ticket.key.id, ticket.request_id)
            # Its admit call may have run in Redis after all; either way Redis learns the real usage.
            for level in ticket.levels():
                self._settle_later(level, ticket.request_id, ticket.model, status, prompt, completion, replica, cost)
            return
        if self._leased.pop(ticket.request_id, None) is not None and self.overlap is not None:
            self.overlap.ended(ticket.key.id)
        for level in ticket.levels():
            self._spawn(self._settle_now(
                (level, ticket.request_id, status, prompt, completion, replica, ticket.model, cost),
                ticket.trace if level is ticket.key else None,
            ))

    async def _settle_now(self, settlement: tuple, trace=None) -> None:
        """``trace``: the request's, which gets a ``settle`` span (after its answer)."""
        started = now_ns()
        try:
            settled = await self.admission.settle(*settlement)
        except REDIS_FAILED as exc:
            self.telemetry.redis_failed("accounting")
            logger.warning("Redis did not take a settlement (%s): retrying it", type(exc).__name__)
            key, request_id, status, prompt, completion, replica, model, cost = settlement
            self._settle_later(key, request_id, model, status, prompt, completion, replica, cost)
            if trace is not None:
                trace.stage("settle", started, **{"llm.settle.status": settlement[2], "error.type": type(exc).__name__})
            return
        if trace is not None:
            trace.stage("settle", started, **{"llm.settle.status": settlement[2]})
        if settled is not None and settled.record is not None and self.records is not None:
            await self.records.ship(settled.record)

    def _settle_later(self, key, request_id, model, status, prompt, completion, replica="", cost=Cost()) -> None:
        if len(self._unsettled) >= MAX_UNSETTLED:
            dropped = next(iter(self._unsettled))
            del self._unsettled[dropped]
            logger.warning("settlement backlog full: dropped %s (its lease expires instead)", dropped)
        self._unsettled[f"{key.id}/{request_id}"] = (key, request_id, status, prompt, completion, replica, model, cost)

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(self._logged(coroutine))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _logged(self, coroutine) -> None:
        try:
            await coroutine
        except REDIS_FAILED as exc:
            # Bookkeeping only (first-token time, the x-request-id index): nothing leaks.
            self.telemetry.redis_failed("accounting")
            logger.warning("Redis failed while accounting a request: %s", type(exc).__name__)

    # -- maintenance (one loop per ingress) -------------------------------------

    def start_maintenance(self) -> None:
        """Start the loop on the running event loop (Serve runs ``__init__`` on it)."""
        if self._maintainer is None:
            self._maintainer = asyncio.get_running_loop().create_task(self.maintain())
            if self.records is not None:
                self.records.start()

    async def maintain(self) -> None:
        if self.ingress_replicas.autoscaled:
            await self.ingress_replicas.refresh()
        last_renewal = last_count = last_check = time.monotonic()
        tick_s = min(MAINTENANCE_TICK_S, self.renew_every_s)
        while True:
            await asyncio.sleep(tick_s)
            now = time.monotonic()
            try:
                if self._unsettled:
                    await self.flush_unsettled()
                if now - last_renewal >= self.renew_every_s:
                    last_renewal = now
                    await self.renew_leases()
                if now - last_check >= self.revocation_check_s:
                    last_check = now
                    await self.stop_revoked()
                if self.ingress_replicas.autoscaled and now - last_count >= REPLICA_COUNT_REFRESH_S:
                    last_count = now
                    await self.ingress_replicas.refresh()
            except Exception:  # never let one bad tick end the loop
                logger.exception("quota maintenance tick failed")

    async def flush_unsettled(self) -> int:
        """Settle what Redis missed, in one pipeline; what it still misses stays queued."""
        batch = list(self._unsettled.values())[:1000]
        try:
            answered = await self.admission.settle_many(batch)
        except REDIS_FAILED:
            return 0  # still unreachable: next tick
        for settlement, (done, settled) in zip(batch, answered):
            if done:
                self._unsettled.pop(f"{settlement[0].id}/{settlement[1]}", None)
            if settled is not None and settled.record is not None and self.records is not None:
                await self.records.ship(settled.record)
        return sum(done for done, _ in answered)

    async def stop_revoked(self) -> int:
        """Read the keys of the requests running here again and mark those of a key
        now revoked or disabled (a stream's relay ends it at its next item, charged
        what it delivered; a unary call is cancelled through ``on_revoke``).
        Returns how many were marked."""
        running: dict[str, list[Ticket]] = {}
        for ticket in self._leased.values():
            if ticket.revoked:
                continue
            # A JWT user is not in the key store (its token's expiry is its revocation):
            # only its team is read again.
            if not is_jwt_identity(ticket.key.id):
                running.setdefault(ticket.key.id, []).append(ticket)
            elif ticket.team is not None:
                running.setdefault(ticket.team.id, []).append(ticket)
        marked = 0
        for account_id, tickets in running.items():
            try:
                if is_team_id(account_id):
                    team = await self.teams.get(account_id)
                    gone = not team.enabled
                else:
                    gone = await self.keys.active(account_id) is None
            except TeamNotFound:
                gone = True
            except REDIS_FAILED:
                return marked  # unknown now: the next check
            if gone:
                for ticket in tickets:
                    ticket.revoked = True
                    if ticket.on_revoke is not None:
                        ticket.on_revoke()
                marked += len(tickets)
        return marked

    async def renew_leases(self) -> None:
        """One pipeline renewing the leases of every request this ingress runs."""
        running: dict[str, list[str]] = {}
        for ticket in self._leased.values():
            for level in ticket.levels():
                running.setdefault(level.id, []).append(ticket.request_id)
        try:
            await self.admission.renew(running)
        except REDIS_FAILED as exc:
            self.telemetry.redis_failed("renew")
            logger.warning("could not renew concurrency leases: %s", type(exc).__name__)


class IngressReplicas:
    """How many ingress replicas share a key's limits while Redis is down: the
    configured count, or for an autoscaled ingress the running count Serve
    reports (refreshed every ``REPLICA_COUNT_REFRESH_S``; until known, the
    autoscaler's maximum, which errs on the strict side)."""

    def __init__(self, deployment: dict):
        autoscaling = deployment.get("autoscaling_config")
        replicas = deployment.get("num_replicas", 1)
        self.autoscaled = bool(autoscaling) or not isinstance(replicas, int)
        if self.autoscaled:
            maximum = (autoscaling or {}).get("max_replicas") if isinstance(autoscaling, dict) else None
            self._count = int(maximum or 100)  # Serve's default max for num_replicas "auto"
        else:
            self._count = max(replicas, 1)

    def count(self) -> int:
        return self._count

    async def refresh(self) -> None:
        try:
            running = await asyncio.to_thread(_running_replicas_of_this_deployment)
        except Exception:  # the controller is busy or away: keep the last count
            logger.warning("could not read the ingress replica count from Serve", exc_info=True)
            return
        if running:
            self._count = running


def _running_replicas_of_this_deployment() -> int:
    from ray import serve

    context = serve.get_replica_context()
    status = serve.status().applications[context.app_name].deployments[context.deployment]
    return int(status.replica_states.get("RUNNING", 0))


def _secret_from(headers) -> str | None:
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    # Azure's header, and Anthropic's (its SDK sends the key nowhere else).
    return headers.get("api-key") or headers.get("x-api-key") or None
