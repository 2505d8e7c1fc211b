"""Whether a request runs now, and settling what it used: admission on the hot path.

One ``Gatekeeper`` per ingress replica (and per direct-route replica) wraps the
admission scripts (``scripts.py``) with what the hot path needs: admission that
answers a ``Ticket`` or a ``Refusal`` (its caller words it:
serve_app/pipeline/refusals.py), fire-and-forget bookkeeping that never delays a
response, and the Redis-down behaviour that ``fail_mode`` chooses.

Redis failures are told apart (docs/quotas.md, "Keys and quotas"):
- unreachable (connection refused or lost, timeout; a Redis Cluster with a slot
  between primaries, CLUSTERDOWN or TRYAGAIN; a cluster client tries a call once,
  others retry): ``fail_mode`` decides, but while this process' own loop runs a quarter of a
  timeout late (loop_lag.py) the ingress is overloaded, and the request is shed
  (503 ``gateway_overloaded``, retry-after); and
  every request the ingress decided without Redis is settled through Redis
  once it answers again. A timed-out call may still have run, and settling is
  idempotent, so nothing that call wrote outlives the request.
- any other error (a script error, OOM, READONLY after a failover, MOVED):
  Redis answered and refused to work, so the request gets 503
  ``quota_backend_error``; it is never admitted without its quota.

The loop that renews leases and retries settlements Redis missed is ``maintenance.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from contract.replica_wire import Usage
from serve_app.accounting.costs import Cost
from serve_app.accounting.record_shipper import RecordShipper
from serve_app.accounting.usage import is_own_key, new_request_id
from serve_app.admission.local_limits import LocalLimiter
from serve_app.admission.loop_lag import LoopLag
from serve_app.admission.overlap import OverlapGuard
from serve_app.admission.scripts import AdmissionScripts, Settlement
from serve_app.admission.seam import Decision, EdgeAdmissionSettled, LocalOrigin, Refusal, Ticket
from serve_app.errors import (
    OpenAIError,
    gateway_overloaded,
    quota_store_error,
    quota_store_unavailable,
    records_backlog,
)
from serve_app.identity.jwt_auth import is_jwt_identity
from serve_app.identity.keys import KeyRecord
from serve_app.identity.teams import TeamRecord
from serve_app.identity.token_users import TokenUsers
from serve_app.redis_store import redis_names
from serve_app.redis_store.redis_client import REDIS_FAILED, UNREACHABLE
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry
from serve_app.tracing import now_ns

logger = logging.getLogger("ray.serve")

# Settlements waiting for Redis to answer again: beyond this many, the oldest is
# dropped (its lease then expires and the next admission of its key reaps it).
MAX_UNSETTLED = 10_000


class Gatekeeper:
    def __init__(
        self,
        redis,
        settings: AppSettings,
        telemetry: Telemetry,
        team_of: Callable[[KeyRecord, str], Awaitable[TeamRecord | None]],
        replica_count: Callable[[], int],
        records: RecordShipper | None = None,
        loop_lag: LoopLag | None = None,
    ):
        """``team_of(key, model)``: the key's team as admission applies it (a 401/403 for a
        team that refuses it: identity/authentication.py); ``replica_count()``: how many
        replicas share a key's limits while Redis is down (maintenance.IngressReplicas);
        ``records``: where settled records go (None: they stay in Redis); ``loop_lag``:
        this process' watcher, when the authenticator shares it."""
        self.telemetry = telemetry
        quota = settings.quota
        self.records = records
        self._team_of = team_of
        self.admission = AdmissionScripts(
            redis,
            lease_s=quota.concurrency_lease_s,
            retention_s=quota.request_retention_s,
            settled_s=settings.records.recent_s if records is not None else None,
            replicas_to_acknowledge=quota.replicas_to_acknowledge,
            acknowledge_timeout_ms=quota.replica_ack_timeout_ms,
        )
        self.token_users = TokenUsers(redis)
        if records is not None:  # a settled record goes to the outbox in its settlement's turn
            records.ship_through(self.admission.pipeline)
        self.fail_open = quota.fail_mode == "open"
        self.default_max_tokens = quota.default_max_tokens
        # Which keys' streams may start before their admission returns (overlap.py).
        self.overlap = OverlapGuard() if quota.overlap_admission else None
        self.local = LocalLimiter(replica_count)
        # A Redis timeout while this process' loop runs late is its own overload, not
        # Redis': shed, never admitted on local limits (loop_lag.py).
        self.loop_lag = loop_lag or LoopLag.judging(quota.redis_timeout_s)
        self._shed_lag_s = quota.shed_loop_lag_s
        self._background: set[asyncio.Task] = set()
        # Requests admitted through Redis and not settled yet: their leases are renewed.
        self._leased: dict[str, Ticket] = {}
        # request id -> Admission.settle arguments, for settlements Redis has not taken yet.
        self._unsettled: dict[str, Settlement] = {}
        # account id -> when this ingress last put it in the due index (monotonic s): see _register_due.
        self._registered: dict[str, float] = {}
        # Accounts whose registration Redis did not take: registered again at the next tick.
        self._unregistered: set[str] = set()
        self._lease_s = quota.concurrency_lease_s

    def running_tickets(self) -> list[Ticket]:
        """The requests admitted through Redis here and not settled yet (maintenance renews them)."""
        return list(self._leased.values())

    # -- admission -------------------------------------------------------------

    async def team_of(self, key: KeyRecord, model: str) -> TeamRecord | None:
        """The key's team as admission applies it (cached; a 401/403 for a team that refuses it)."""
        return await self._team_of(key, model)

    def may_start_before_admission(self, key: KeyRecord, reserve_tokens: int) -> bool:
        """Whether a stream of ``key`` may go to the engine while its admission is
        in Redis (overlap.py); if so, the room it assumes is spent."""
        return self.overlap is not None and self.overlap.try_spend(key, reserve_tokens)

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
    ) -> Ticket | Refusal:
        """A ``Ticket`` to run, or the ``Refusal`` of a limit of the key or of its team
        (rendered by the caller). A quota store that cannot decide raises its 503.
        ``request_id``: the id the request was already sent to the engine under (an
        overlapped admission); a new one otherwise. ``reserve_nanos``: the cost of
        the reservation, held against the money budgets. ``request_paid``: admitted
        again at its prompt's real size, its requests/min charged by its first
        admission at every level (``withdraw(keep_request=True)``). ``given_id``: the
        id the edge gave this admission of the request (Gateway ``_edge_id``), the same for
        each try the edge makes of it: a try after the first takes over the first's open
        admission (admit.lua's 'again'), so the request is charged once; one whose id is
        settled raises ``EdgeAdmissionSettled``, admitting nothing."""
        if self.records is not None and self.records.backlogged:
            raise records_backlog()  # back-pressure: the sink is down, Redis holds its bound of records
        # Sent to the engine already (an overlapped admission): it may have run.
        may_have_run = request_id is not None
        request_id = request_id or given_id or new_request_id(key.id)
        team = await self._team_of(key, model)
        levels = [key] if team is None else [key, team]
        started = time.perf_counter()
        called_at = self.loop_lag.clock()
        try:
            # Level by level, the key first, each on its own slot, stopping at the first
            # that refuses; the levels that admitted it are then taken back (below). So a
            # team's room is only ever held by requests their key admitted: sent at once,
            # keys over their own limit would hold the team's places while their
            # admissions were taken back, and refuse requests that fit (measured: 1 of 20
            # admitted where 7 fit). The price: a round trip per level.
            decisions = []
            for level in levels:
                self._register_due([level.id])  # in the same pipeline flush as its admission
                decisions.append(
                    await self.admission.admit(
                        level,
                        request_id,
                        model,
                        reserve_tokens,
                        http_request_id if level is key else "",
                        reserve_nanos,
                        team.id if team is not None and level is key else "",
                        request_paid,
                    )
                )
                if not decisions[-1].admitted:
                    break
        except asyncio.CancelledError:
            # The client left while its admission was on the wire: the call still
            # runs in Redis (auto_pipeline), so the id is settled, which frees a
            # lease it took or makes a later admit of it change nothing. Unless its
            # stream started beside its admission (a request's record: cancelled),
            # nothing ran: withdrawn, a tombstone never shipped.
            self._take_back(levels, request_id, model, "cancelled" if may_have_run else "withdrawn", taken_back=True)
            raise
        except UNREACHABLE as exc:
            self.telemetry.redis_failed("admit")
            self._no_overlap(key)  # no guesses while Redis cannot answer
            if self._overloaded(exc, called_at):
                self._take_back(levels, request_id, model)
                raise gateway_overloaded() from None
            try:
                admitted = self._admit_locally(key, request_id, model, reserve_tokens, exc, http_request_id)
            except OpenAIError:
                self._take_back(levels, request_id, model)
                raise
            if isinstance(admitted, Refusal):
                self._take_back(levels, request_id, model)
            else:
                admitted.team = team  # the team's share is not kept locally: settled through Redis later
            return admitted
        except REDIS_FAILED as exc:
            self.telemetry.redis_failed("admit")
            self._no_overlap(key)
            logger.error("Redis refused the admission script: %s", exc)
            self._take_back(levels, request_id, model)  # undo what a failed script wrote
            raise quota_store_error() from None
        self.telemetry.admission_took(time.perf_counter() - started)
        decision, last = decisions[0], decisions[-1]
        self._record_budget_use(key, decision)
        if last.kind == "duplicate":
            # The edge's try again of a request whose earlier try died and was reaped
            # (abandoned: nothing was answered): the gateway goes on to the edge's next id.
            # Settled any other way, it was answered (a unary answer settles before its
            # bytes are written): never run a second time.
            if given_id is not None and request_id == given_id and last.detail == "abandoned":
                if len(decisions) > 1:  # the key took the first over ('again'); only its team's was reaped
                    await self._release(key, request_id, model, "")
                raise EdgeAdmissionSettled(request_id)
            raise quota_store_error()  # its id settled before this admission ran: never while we wait on it
        if not last.admitted:  # the level that refused is the last one asked
            self._no_overlap(key)
            if len(decisions) > 1:  # the team: the key's admission is taken back
                await self._release(levels[0], request_id, model, "team_" + last.kind)
            if team is not None:
                self.telemetry.team_refused(team.name, "key" if len(decisions) == 1 else "team")
            return Refusal(
                last.as_applied(levels[len(decisions) - 1]),
                last.kind,
                reserve_tokens,
                last,
                level="key" if len(decisions) == 1 else "team",
                reserved_nanos=reserve_nanos,
            )
        if self.overlap is not None:
            self.overlap.admitted(key, decision)
        ticket = Ticket(key, request_id, model, decision.headers(key), team=team)
        if decision.kind == "again" and given_id is not None:  # the edge's try again: the record says so
            ticket.failover.append("edge:retried")
        self._leased[request_id] = ticket
        if http_request_id:
            self._spawn(self.admission.index_http_id(http_request_id, request_id))
        if is_jwt_identity(key.id):  # listed where keys are (usage, costs, console)
            self._spawn(self.token_users.seen(key, team.id if team else None, self.admission.pipeline.command))
        return ticket

    async def refusal_before_body(self, key: KeyRecord) -> Refusal | None:
        """The refusal of a request of ``key`` by its requests/min or concurrency as they
        stand now (no charge: ``AdmissionScripts.room``), asked before a large body is read;
        None when it has room, or when Redis cannot say (its admission decides then)."""
        if key.requests_per_minute <= 0 and key.max_concurrent <= 0 and not redis_names.has_stored_limits(key.id):
            return None
        try:
            decision = await self.admission.room(key)
        except (*UNREACHABLE, *REDIS_FAILED):
            return None
        if decision.admitted:
            return None
        self._no_overlap(key)
        return Refusal(decision.as_applied(key), decision.kind, 0, decision)

    def _take_back(
        self, levels: list[KeyRecord], request_id: str, model: str, status: str = "withdrawn", taken_back: bool = False
    ) -> None:
        """An admission whose answer was not had taken back at every level, in case its
        call ran in Redis: settled later as ``status`` with no usage (a withdrawn one is
        a tombstone, never shipped: settle.lua)."""
        for level in levels:
            self._settle_later(Settlement(level, request_id, status, model=model, taken_back=taken_back))

    async def withdraw(self, ticket: Ticket, keep_request: bool = False) -> None:
        """Take a ticket's admission back as if it never happened, at every level: its
        request ran nothing and is admitted again (a prompt the replica counted larger
        than its reservation: serve_app/pipeline/gateway.py), so its reservation does
        not count twice. Not a refusal either. ``keep_request``: its request of
        requests/min stays charged, once (the replica rendered it: a render is a
        request, whether or not it is admitted again). A ticket
        admitted without Redis is settled as withdrawn instead (its local share; its
        record a tombstone that is never shipped: settle.lua)."""
        if ticket.settled:
            return
        if ticket.local:
            self.settle(ticket, "withdrawn", Usage())
            return
        ticket.settled = True
        if ticket.on_settle is not None:
            ticket.on_settle()
        if self._leased.pop(ticket.request_id, None) is not None and self.overlap is not None:
            self.overlap.ended(ticket.key.id)
        for level in ticket.levels():
            await self._release(level, ticket.request_id, ticket.model, "", keep_request)

    async def _release(
        self, level: KeyRecord, request_id: str, model: str, refused_by: str, keep_request: bool = False
    ) -> None:
        """Take back a level's admission of a request another level refused or that is
        admitted again. If Redis does not take it now, it is settled as withdrawn later
        (its reservation given back; its request stays counted; a tombstone record)."""
        try:
            await self.admission.release(level, request_id, refused_by, keep_request)
        except REDIS_FAILED:
            self.telemetry.redis_failed("admit")
            self._settle_later(Settlement(level, request_id, "withdrawn", model=model))

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

    def overloaded(self) -> bool:
        """Whether this process' loop runs so late (``quota.shed_loop_lag_s``) that a new
        request is refused before it adds to the backlog. The soak's direct-route
        replicas, each relaying hundreds of paced streams on a share of 2 cores, fell
        30 s behind, failed Serve's health checks and were replaced, their requests
        with them (and a model left without a replica for a minute): shedding keeps a
        replica answering while what it holds drains."""
        if not self._shed_lag_s or self.loop_lag.recent_s() < self._shed_lag_s:
            return False
        self.telemetry.fell_back("shed_loop_lag")
        return True

    def _overloaded(self, exc: BaseException, since: float) -> bool:
        """Redis unreachable while this process' loop ran late enough to make it so
        (loop_lag.py): a reply or a connect not handled in time (redis-py words a connect
        that timed out as a ConnectionError), or an outage met while overloaded, when
        shedding is the answer anyway."""
        if not self.loop_lag.late_during(since):  # while the call was out: a stall before it is not its cause
            return False
        lag_s = self.loop_lag.recent_s(since)
        self.telemetry.fell_back("shed_overloaded")
        logger.warning(
            "Redis unreachable (%s) while this ingress' loop ran %.2f s late: shed, not admitted locally",
            what_failed(exc),
            lag_s,
        )
        return True

    def _admit_locally(
        self, key: KeyRecord, request_id: str, model: str, reserve_tokens: int, exc, http_request_id: str
    ) -> Ticket | Refusal:
        if not self.fail_open:
            raise quota_store_unavailable()
        self.telemetry.fell_back("local_limits")
        logger.warning(
            "Redis unreachable (%s): admitting on local limits (loop %.2f s late at most lately)",
            what_failed(exc),
            self.loop_lag.recent_s(),
        )
        admitted, kind, retry_s = self.local.admit(key, request_id, reserve_tokens)
        if not admitted:
            return Refusal(key, kind, reserve_tokens, retry_s=retry_s)
        origin = LocalOrigin(http_request_id, int(time.time() * 1000))
        return Ticket(key, request_id, model, {}, local=True, origin=origin)

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
            self.telemetry.team_charged(
                ticket.team.name, max(prompt, 0), max(completion, 0), reserved, cost.nanos, cached_prompt=cached
            )
        settlements = [
            Settlement(
                level,
                ticket.request_id,
                status,
                prompt,
                completion,
                replica,
                ticket.model,
                cost,
                ticket.origin,  # None unless admitted without Redis
                failover=",".join(ticket.failover),
            )
            for level in ticket.levels()
        ]
        if ticket.local:
            self.local.release(ticket.key.id, ticket.request_id)
            # Its admit call may have run in Redis after all; either way Redis learns the real usage.
            for settlement in settlements:
                self._settle_later(settlement)
            return
        if self._leased.pop(ticket.request_id, None) is not None and self.overlap is not None:
            self.overlap.ended(ticket.key.id)
        for settlement in settlements:
            self._spawn(self._settle_now(settlement, ticket.trace if settlement.key is ticket.key else None))

    async def _settle_now(self, settlement: Settlement, trace=None) -> None:
        """``trace``: the request's, which gets a ``settle`` span (after its answer)."""
        started = now_ns()
        try:
            settled = await self.admission.settle(*settlement)
        except REDIS_FAILED as exc:
            self.telemetry.redis_failed("accounting")
            logger.warning("Redis did not take a settlement (%s): retrying it", what_failed(exc))
            self._settle_later(settlement)
            if trace is not None:
                trace.stage(
                    "settle", started, **{"llm.settle.status": settlement.status, "error.type": type(exc).__name__}
                )
            return
        if trace is not None:
            trace.stage("settle", started, **{"llm.settle.status": settlement.status})
        if settled is not None and settled.record is not None and self.records is not None:
            await self.records.ship(settled.record)

    def _settle_later(self, settlement: Settlement) -> None:
        if len(self._unsettled) >= MAX_UNSETTLED:
            dropped = next(iter(self._unsettled))
            del self._unsettled[dropped]
            logger.warning("settlement backlog full: dropped %s (its lease expires instead)", dropped)
        self._unsettled[f"{settlement.key.id}/{settlement.request_id}"] = settlement

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
            logger.warning("Redis failed while accounting a request: %s", what_failed(exc))

    # -- what the maintenance loop runs (maintenance.py) ----------------------

    async def flush_unsettled(self) -> int:
        """Settle what Redis missed, in one pipeline; what it still misses stays queued."""
        if not self._unsettled:
            return 0
        batch = list(self._unsettled.values())[:1000]
        try:
            answered = await self.admission.settle_many(batch)
        except REDIS_FAILED:
            return 0  # still unreachable: next tick
        final, indexed = [], []
        for settlement, (done, settled) in zip(batch, answered):
            if done:
                self._unsettled.pop(f"{settlement.key.id}/{settlement.request_id}", None)
                origin, request_id = settlement.origin, settlement.request_id
                if origin is not None and origin.http_request_id and is_own_key(settlement.key.id, request_id):
                    # Admitted without Redis: its x-request-id is indexed now that its record
                    # exists, as an admission's is (`requests show <x-request-id>` finds it).
                    indexed.append(self._logged(self.admission.index_http_id(origin.http_request_id, request_id)))
            if settled is not None and settled.record is not None:
                final.append(settled.record)
        await asyncio.gather(self._ship(final), *indexed)
        return sum(done for done, _ in answered)

    async def _ship(self, records: list[dict]) -> None:
        """Hand final records to the sink at once: their XADDs share one pipeline turn
        (one at a time, up to 1,000 of them after an outage took round trips each on a
        loaded replica)."""
        if self.records is not None and records:
            await asyncio.gather(*(self.records.ship(record) for record in records))

    def _register_due(self, account_ids: list[str]) -> None:
        """Keep ``account_ids`` in the due index past their leases' expiry, so that the
        reaper finds the requests this ingress leaves if it dies (reap_abandoned). A
        registration is due a lease and a half after it is made, so it covers every
        lease taken in the half lease after it: an account is registered at most once
        per half lease by each ingress (its admissions, its renewals), not per request."""
        now = time.monotonic()
        half = self._lease_s / 2
        stale = [a for a in account_ids if now - self._registered.get(a, float("-inf")) >= half]
        if not stale:
            return
        if len(self._registered) > 10_000:  # registrations older than half a lease are renewed anyway
            self._registered = {a: at for a, at in self._registered.items() if now - at < half}
        due_ms = int(time.time() * 1000 + self._lease_s * 1500)
        for account, call in zip(stale, self.admission.register_due(stale, due_ms)):
            self._registered[account] = now
            call.add_done_callback(self._registration_done(account))

    def _registration_done(self, account: str):
        def done(call: asyncio.Future) -> None:
            if call.cancelled() or call.exception() is not None:
                # Again at the next maintenance tick, not the next admission or renewal:
                # this ingress may die before either, and its leases would then never be
                # reaped (the soak's 30-minute run left one request `running` so).
                self._registered.pop(account, None)
                self._unregistered.add(account)

        return done

    async def reap_abandoned(self) -> int:
        """Finalise the requests whose ingress died (their leases expired unrenewed) of
        the accounts the due index says are due, and ship their records; how many."""
        if self._unregistered:
            accounts, self._unregistered = list(self._unregistered), set()
            self._register_due(accounts)
        try:
            accounts = await self.admission.due_accounts()
            reaped = await asyncio.gather(*(self.admission.reap(account) for account in accounts))
        except REDIS_FAILED:
            return 0  # next tick
        final = [record for _, records in reaped for record in records]
        await self._ship(final)
        if final:
            logger.warning("finalised %d requests whose ingress stopped renewing their leases", len(final))
        return len(final)

    async def renew_leases(self) -> bool:
        """One pipeline renewing the leases of every request this ingress runs; False
        when Redis did not take it (the caller tries again at its next tick)."""
        running: dict[str, list[str]] = {}
        for ticket in self._leased.values():
            for level in ticket.levels():
                running.setdefault(level.id, []).append(ticket.request_id)
        # A request that ended while Redis did not take its settlement keeps its lease
        # until the settlement lands: else the reaper finalises it `abandoned` a lease
        # later (its reservation charged) and the settlement, when it lands, finds it
        # final (the soak: 5 requests charged their reservation, not what they used).
        # renew.lua renews only a lease whose record is still open.
        for settlement in self._unsettled.values():
            running.setdefault(settlement.key.id, []).append(settlement.request_id)
        self._register_due(list(running))
        try:
            await self.admission.renew(running)
        except REDIS_FAILED as exc:
            self.telemetry.redis_failed("renew")
            logger.warning("could not renew concurrency leases: %s", what_failed(exc))
            return False
        return True


def what_failed(exc: BaseException) -> str:
    """A Redis failure for the log: its kind and what it says (which node, which
    error), cut short."""
    said = str(exc)
    return f"{type(exc).__name__}: {said[:200]}" if said else type(exc).__name__
