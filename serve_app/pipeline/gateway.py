"""One request through the gateway, whatever route or dialect it came in by.

Every route (OpenAI's own, Azure's, SageMaker's, Databricks', ...) turns its
request into a canonical OpenAI body for one ``Operation`` and hands it to
``Gateway.run``: model lookup, per-key authorisation, admission against the
key's quotas, the call to the model's replicas, and settlement of what the
request really used. The route then sends the ``Reply`` back as it is, or in
its dialect's shape.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, RequestCancelledError
from ray.serve.handle import DeploymentHandle

from contract.edge import MAX_SESSION_ID_CHARS
from contract.model_config import VLLM_PRIORITY, ModelConfig, PriorityTier, deployment_name
from contract.replica_wire import AVOID, ReplicaAnswer, ReplicaError, Usage
from serve_app.accounting.costs import Rates, reservation_nanos
from serve_app.accounting.usage import edge_attempt_tag, new_request_id
from serve_app.admission.seam import Admitter, EdgeAdmissionSettled, Refusal, Ticket
from serve_app.errors import RETRY_HEADERS, OpenAIError, from_engine_error, gateway_overloaded, unknown_model
from serve_app.identity.authentication import authorize
from serve_app.identity.cache_isolation import CacheSalts, client_salt_of, take_prompt_cache_key
from serve_app.identity.keys import KeyRecord
from serve_app.identity.teams import TeamRecord
from serve_app.pipeline.catalog import ModelCatalog
from serve_app.pipeline.fair_share import FairShareQueue, TokenWeights, VirtualTokenCounter
from serve_app.pipeline.refusals import render as render_refusal
from serve_app.pipeline.relay import relay as relay_stream
from serve_app.pipeline.replica_calls import QueueTimeout, only_item, reach_replica
from serve_app.pipeline.replica_request import GatewayFields, replica_body
from serve_app.ray_private import assigned_call
from serve_app.routing import outliers
from serve_app.routing.outliers import OutlierEjector
from serve_app.routing.places import replica_places
from serve_app.telemetry import RequestRecord, Telemetry
from serve_app.tracing import RequestTrace, now_ns, replica_context
from serve_app.wire.api_requests import OPERATIONS, Operation, check_message_count, validate_request
from serve_app.wire.calls import Reply
from serve_app.wire.media import check_media
from serve_app.wire.parameters import apply_parameter_policy
from serve_app.wire.reservation import Reservation, reserve
from serve_app.wire.sse import STREAM_SHAPES

logger = logging.getLogger("ray.serve")


def _unavailable(ticket: Ticket, message: str, code: str) -> OpenAIError:
    """503, never 429: the cluster is busy, the key's quota is fine."""
    return OpenAIError(503, message, code=code, headers={**ticket.headers, **RETRY_HEADERS})


def _engine_error(ticket: Ticket, refused: ReplicaError) -> OpenAIError:
    """An error the replica answered; its 503 (engine gone) tells when to retry."""
    exc = from_engine_error(refused.status, refused.error)
    exc.headers = {**ticket.headers, **(RETRY_HEADERS if refused.status == 503 else {})}
    return exc


class _PromptOverReservation(Exception):
    """The replica counted more prompt tokens than were reserved; nothing ran."""

    def __init__(self, prompt_tokens: int):
        super().__init__(prompt_tokens)
        self.prompt_tokens = prompt_tokens


def _edge_id(key: KeyRecord, record: RequestRecord) -> str | None:
    """The id of the request's next admission, from the id the edge named it by: the
    same sequence on every try the edge sends of it (its first admission, then one per
    prompt resize or fallback), so a try again on another replica that comes to the same
    admission takes over the first's, still open (admit.lua's 'again'): charged once.
    None without the edge's id, or past ``EDGE_ADMISSIONS``: a new id then."""
    attempt, record.edge_admissions = record.edge_admissions, record.edge_admissions + 1
    if not record.edge_tag or attempt >= EDGE_ADMISSIONS:
        return None
    return f"{key.id}-{edge_attempt_tag(record.edge_tag, attempt)}"


class _FailedBeforeFirstByte(Exception):
    """A replica failed the request before it sent anything on (``reason``: 'died',
    'answered_5xx', 'stalled'); nothing is settled yet: it may be sent again."""

    def __init__(self, reason: str, replica: str, refused: ReplicaError | None = None):
        super().__init__(reason)
        self.reason, self.replica, self.refused = reason, replica, refused


class _NoReplicaCanServe(Exception):
    """No replica of the model could take the request (full, none reached in time, or
    every try failed): its admission is withdrawn, and ``error`` is the client's answer
    unless a fallback model serves it."""

    def __init__(self, error: OpenAIError, plan: _Plan):
        super().__init__(error.message)
        self.error, self.plan = error, plan


# The header an answer from a fallback model names the model the client asked for in.
FALLBACK_FROM_HEADER = "x-llm-fallback-from"


# How many times a request is admitted again with its prompt as the replica counted
# it: the count is the same on every replica of a model, so once is enough.
PROMPT_RESIZES = 1
# How many of a request's admissions take their id from the edge's (``_edge_id``): its
# first, a resize, a fallback's and its resize, with room; past them a new id.
EDGE_ADMISSIONS = 8


# Operations whose ``prompt_cache_key`` (OpenAI's, on chat and Responses; the edge
# reads it on completions too) is a routing hint: requests of one tenant with one key
# go to one replica while its load allows.
CACHE_KEYED = frozenset({"chat", "completions", "responses"})
# Operations whose engine requests carry the key's tier as vLLM's `priority`.
PRIORITIZED = frozenset({"chat", "completions", "responses"})
# The rank of batch requests (``run(background=True)``): after every key's tier, in
# the engine (vLLM's priority), the fair-share queue and the model's queue.
BACKGROUND_RANK = len(VLLM_PRIORITY)


def _fair_share_queue(config: ModelConfig) -> FairShareQueue:
    share = config.fair_share
    weights = TokenWeights(prompt=share.prompt_weight, completion=share.completion_weight)
    deployment = deployment_name(config.name)
    return FairShareQueue(lambda: replica_places(deployment), VirtualTokenCounter(weights), share.light_key_places)


class Gateway:
    def __init__(
        self,
        access: Admitter,
        models: dict[str, DeploymentHandle],
        configs: list[ModelConfig],
        telemetry: Telemetry,
        salts: CacheSalts,
        describers: dict[str, DeploymentHandle] | None = None,
        start_early: bool = False,
        start_early_when_idle: bool = False,
        elsewhere: dict[str, DeploymentHandle] | None = None,
        own_replica: str = "",
    ):
        self.access = access
        # A direct route's: the handle a request its in-process replica failed goes on by
        # (to another replica of the model), and that replica's id.
        self.elsewhere = elsewhere or {}
        self.own_replica = own_replica
        # Each model's failing replicas, as its router in this process reads them (outliers.py).
        self._ejectors = {
            config.name: outliers.watch(
                deployment_name(config.name),
                OutlierEjector(config.failover.eject_after_failures, config.failover.ejection_s),
            )
            for config in configs
        }
        # Each request's engine cache_salt, from its tenant (identity/cache_isolation.py).
        self.salts = salts
        # Whether a stream may start before its admission (``_start_early``): a model's
        # direct route only, whose replica is in-process. Through the ingress an early
        # call would sit in Serve's queue uncounted by the tiers' queue shares and the
        # fair-share queue while its admission runs (tests/e2e/test_scheduling_e2e.py).
        self.start_early = start_early
        # And on an idle model too (``quota.overlap_admission_when_idle``), not only while it is busy.
        self.start_early_when_idle = start_early_when_idle
        self.telemetry = telemetry
        self.models = models
        # The models as clients name them, and their cards (catalog.py); ``describers``:
        # the handles it describes them through (the clients' own when not given).
        self.catalog = ModelCatalog(configs, describers if describers is not None else models)
        # Requests of each model waiting for a replica at this ingress (Serve's
        # queue for it here): the priority tiers' queue shares are measured on it.
        self._waiting = {config.name: 0 for config in configs}
        # Requests of each model whose admission is in Redis now (busy, for ``_start_early``).
        self._admitting = {config.name: 0 for config in configs}
        for config in configs:  # a fallback is another model served here
            for fallback in config.fallbacks:
                try:
                    target: str | None = self.catalog.resolve(fallback)
                except OpenAIError:
                    target = None
                if target in (None, config.name):
                    raise ValueError(f"model {config.name!r}: fallback {fallback!r} is not another model served here")
        # Fair share between keys while a model's replicas are all busy (fair_share.py).
        self._gates = {config.name: _fair_share_queue(config) for config in configs if config.fair_share.enabled}

    # -- requests --------------------------------------------------------------

    def waiting(self, model: str) -> int:
        """Requests of ``model`` waiting for a replica at this ingress."""
        return self._waiting.get(model, 0)

    async def run(
        self,
        key: KeyRecord,
        operation: str | Operation,
        body: dict[str, Any],
        raw_size: int,
        record: RequestRecord,
        background: bool = False,
        once_admitted: Callable[[], Awaitable[None]] | None = None,
        session: str | None = None,
    ) -> Reply:
        """Admit ``body`` for ``key`` and answer it. Raises ``OpenAIError``.
        ``record`` learns what telemetry needs; a streamed reply finishes it
        when the stream ends, anything else is finished by the caller.
        ``background`` (batches): ranked after every tier, and refused when the
        model's queue is as full as the low tier's share.

        Three stages: ``_plan`` (checks that need no Redis, the reservation),
        ``_admit`` (the key's quotas, the tier's share of the queue) and ``_call``
        (a replica's answer, relayed or whole), which settles what ran.
        ``once_admitted`` completes ``body`` between the last two (a Responses
        follow-up's stored conversation, priced in ``raw_size``): work a refused
        request never costs. Such a request never starts before its admission, nor
        does one admitted again at its prompt's real size.
        ``session`` (the client's session header): the model's request router keeps
        one session's requests on one replica while its load allows.

        When no replica of the model can take it (``_NoReplicaCanServe``), its
        ``fallbacks`` are tried in order, each as a request of its own for that model
        (its prices, its limits, the key's right to it: one it may not use is passed
        over), its admission the only one left standing; none: the original error."""
        try:
            return await self._run(key, operation, body, raw_size, record, background, once_admitted, session)
        except _NoReplicaCanServe as cannot:
            asked = cannot.plan.request.model
            fallbacks = cannot.plan.config.fallbacks
            for i, fallback in enumerate(fallbacks):
                try:
                    reply = await self._run(
                        key,
                        operation,
                        cannot.plan.body_for(fallback),
                        raw_size,
                        record,
                        background,
                        session=session,
                        fallback_from=asked,
                        may_fall_back=i + 1 < len(fallbacks),
                    )
                except _NoReplicaCanServe:
                    continue
                except OpenAIError as exc:
                    if exc.status in (403, 404):  # the key may not use it (or it is unknown): the next
                        continue
                    raise
                self.telemetry.answered_by_fallback(cannot.plan.model, record.model)
                return reply
            raise cannot.error from None

    async def _run(
        self,
        key: KeyRecord,
        operation: str | Operation,
        body: dict[str, Any],
        raw_size: int,
        record: RequestRecord,
        background: bool = False,
        once_admitted: Callable[[], Awaitable[None]] | None = None,
        session: str | None = None,
        fallback_from: str | None = None,
        may_fall_back: bool = True,
    ) -> Reply:
        """``run`` for one model: the one the body names (``fallback_from``: the model
        the client named, when this is its fallback; ``may_fall_back``: whether a
        ``_NoReplicaCanServe`` may come out, when the model has fallbacks)."""
        plan = self._plan(key, operation, body, raw_size, record, background, session)
        plan.fallback_from = fallback_from
        plan.may_fall_back = may_fall_back and (fallback_from is not None or bool(plan.config.fallbacks))
        try:  # the team's right to the model (cached for admission), answered as the key's is
            team = await self.access.team_of(key, plan.model)
        except OpenAIError as exc:
            if exc.code == "model_not_allowed":
                raise unknown_model(plan.request.model) from None
            raise
        plan = await self._isolate(key, team, plan)
        for resizes in range(PROMPT_RESIZES + 1):
            # A resized prompt is known to be denser than its estimate: it waits for its
            # admission, so the engine never prefills it for a request Redis may refuse
            # (and a request starts early at most once).
            may_start_early = once_admitted is None and resizes == 0
            ticket, early = await self._admit(key, plan, record, may_start_early=may_start_early)
            if once_admitted is not None:
                try:
                    await once_admitted()
                except BaseException as exc:  # nothing ran: nothing is charged
                    self.access.settle(ticket, "failed", Usage())
                    if isinstance(exc, OpenAIError):
                        exc.headers = {**ticket.headers, **exc.headers}
                    raise
                once_admitted = None
            try:
                return await self._call(plan, ticket, record, early)
            except _PromptOverReservation as over:
                # The prompt renders to more tokens than its estimate: nothing ran and
                # its admission was withdrawn. Admit it again for what the replica
                # counted (a 429 now if the key's limits cannot hold it), so that the
                # engine never takes more than was reserved.
                if resizes == PROMPT_RESIZES:
                    raise OpenAIError(
                        503,
                        "The prompt's token count changed between two renderings. Please retry.",
                        code="prompt_resize_failed",
                        headers={**ticket.headers, **RETRY_HEADERS},
                    ) from None
                plan = plan.resized(over.prompt_tokens)
                self.telemetry.prompt_resized(plan.model)
        raise AssertionError("unreachable")

    async def refuse_before_body(self, key: KeyRecord) -> None:
        """Raise ``key``'s 429 when its requests/min or concurrency is full now, before its
        request's body is read: a key at those limits costs no more than the 429."""
        refused = await self.access.refusal_before_body(key)
        if refused is not None:
            self.telemetry.refused_unread(refused.kind)
            raise render_refusal(refused)

    async def count_refused_read(self, key: KeyRecord) -> None:
        """A large body that was read (past the room check) and then refused before its
        admission (a 400, 403, 404, 408 or 413) still counts as one of its key's requests:
        admitted with no tokens and settled failed, as a batch line refused before its
        admission is. So reading and parsing such bodies is never free work: a key
        sending them meets its requests/min, and then the room check refuses the next
        before it is read. A key without room now, or Redis that cannot say, changes
        nothing: the client's own error stands."""
        try:
            ticket = await self.access.admit(key, "", 0)
        except OpenAIError:
            return
        if not isinstance(ticket, Refusal):
            self.access.settle(ticket, "failed", Usage())

    def _plan(
        self,
        key: KeyRecord,
        operation: str | Operation,
        body: dict[str, Any],
        raw_size: int,
        record: RequestRecord,
        background: bool,
        session: str | None = None,
    ) -> _Plan:
        """The request checked (shape, parameters, model, the key's right to it,
        media) and priced (its token reservation); raises the client's 4xx."""
        op = OPERATIONS[operation] if isinstance(operation, str) else operation
        record.operation = op.name
        request = validate_request(op, body)
        # The client's cache salt and prompt_cache_key, read before the parameter policy
        # drops what vLLM does not know: _isolate turns them into the tenant's.
        client_salt = client_salt_of(body) if op.cache_salted else None
        cache_key = take_prompt_cache_key(body) if op.name in CACHE_KEYED else None
        apply_parameter_policy(op.name, body)
        model, adapter = self.catalog.target(request.model)
        record.model = model
        handle = self.models[model]
        if adapter is not None:  # Serve model multiplexing: prefer replicas that already hold the adapter
            handle = handle.options(multiplexed_model_id=adapter)
        authorize(key, model, asked=request.model)
        config = self.catalog.config(model)
        context_length = self.catalog.context_length(model)
        if context_length:
            if op.name == "responses":
                check_message_count(body.get("input"), context_length, param="input")
            else:
                check_message_count(body.get("messages"), context_length)
        # Chat, Anthropic messages, embeddings of chat-shaped input (vLLM's multimodal
        # embeddings), and the Responses API's input items (messages with content parts).
        check_media(body.get("input") if op.name == "responses" else body.get("messages"), config.media)
        reservation = reserve(
            op.name,
            body,
            raw_size,
            default_max_tokens=self.access.default_max_tokens,
            context_length=context_length,
        )
        rank = BACKGROUND_RANK if background else VLLM_PRIORITY[key.priority]
        # The name vLLM serves it under (the replica names an adapter itself), and what
        # else the gateway sets on its call (replica_request.py).
        sets = GatewayFields(model, salted=op.cache_salted)
        if reservation.named_for_client is not None:
            sets.max_tokens_field, sets.max_tokens = reservation.named_for_client
        if config.priority_scheduling and op.name in PRIORITIZED:
            sets.priority = rank
        tier = "low" if background else key.priority
        return _Plan(
            op,
            request,
            body,
            model,
            handle,
            config,
            reservation,
            rank,
            tier,
            sets,
            streaming=bool(getattr(request, "stream", False)),
            client_salt=client_salt,
            cache_key=cache_key,
            session=session[:MAX_SESSION_ID_CHARS] if session else None,
            adapter=adapter,
        )

    async def _isolate(self, key: KeyRecord, team: TeamRecord | None, plan: _Plan) -> _Plan:
        """The request's engine ``cache_salt`` set from its tenant (its key's, its team's,
        or none: identity/cache_isolation.py), so that no tenant's prompt is served from
        another's cache, on every way work gets in (each takes ``run``); and its routing
        session: the client's session header, else its ``prompt_cache_key``, hashed
        within its tenant (never another tenant's session). The model's router reads
        both (the salt is part of its prompt text)."""
        if not (plan.op.cache_salted or plan.session):
            return plan
        salt = None
        if plan.op.cache_salted:
            salt = await self.salts.salt(key, team, plan.config, plan.client_salt)
            plan.sets.cache_salt = salt
        session = await self.salts.routing_session(key, team, plan.config, salt, plan.session, plan.cache_key)
        if session:  # the model's router keeps a session on one replica
            plan = dataclasses.replace(plan, handle=plan.handle.options(session_id=session), routing_session=session)
        return plan

    async def _admit(
        self, key: KeyRecord, plan: _Plan, record: RequestRecord, may_start_early: bool = True
    ) -> tuple[Ticket, _EarlyStart | None]:
        """The key's quotas in Redis (a refusal rendered as its 429), then the tier's
        share of the model's queue (503 when full). A stream of a key with room to
        spare may start in the engine meanwhile (serve_app/admission/overlap.py); nothing
        is relayed before Redis admits it."""
        if self.access.overloaded():  # this replica's loop far behind: nothing more until it catches up
            raise gateway_overloaded()
        model = plan.model
        queue_limit = plan.config.priority.queue_limit(plan.tier, plan.config.max_queued_requests)
        queue_full = self._queue_full(model, queue_limit)
        edge_id = _edge_id(key, record)
        early = (
            self._start_early(plan, key, record, edge_id)
            if self.start_early and may_start_early and plan.streaming and not queue_full
            else None
        )
        # Priced (accounting/costs.py): a batch request at the model's batch discount. The
        # reservation's cost is held against money budgets until settlement.
        rates = Rates.of(plan.config.pricing, batch=plan.rank == BACKGROUND_RANK)
        reserved = (plan.reservation.prompt, plan.reservation.tokens - plan.reservation.prompt)
        self._admitting[model] += 1
        admission_started = now_ns()
        skipped = False
        try:
            while True:
                try:
                    admitted = await self.access.admit(
                        key,
                        model,
                        plan.reservation.tokens,
                        # Ray Serve's id for this HTTP request: it answers it as x-request-id.
                        record.request_id,
                        request_id=early.request_id if early else None,
                        reserve_nanos=reservation_nanos(rates, *reserved),
                        request_paid=plan.rendered,
                        given_id=edge_id,
                    )
                    break
                except EdgeAdmissionSettled:
                    # The edge's try again, and the reaper settled its earlier try's
                    # admission under this id (its replica died, no other was up to take
                    # the try in time): the next id, admitted as a new request.
                    if early is not None:
                        early.withdraw()
                        self.telemetry.started_early(model, "withdrawn")
                        early = None
                    edge_id, skipped = _edge_id(key, record), True
        except BaseException:
            if early is not None:
                early.withdraw()  # the quota store failed, or the client left: the engine aborts it
                self.telemetry.started_early(model, "withdrawn")
            raise
        finally:
            self._admitting[model] -= 1
        if record.trace is not None:
            record.trace.stage(
                "admission",
                admission_started,
                **{"llm.early_start": early is not None, "llm.admitted": not isinstance(admitted, Refusal)},
            )
        if isinstance(admitted, Refusal):
            if early is not None:
                early.withdraw()
                self.telemetry.started_early(model, "withdrawn")
            raise render_refusal(admitted)
        ticket = admitted
        ticket.rates, ticket.reserved, ticket.trace = rates, reserved, record.trace
        if skipped and "edge:retried" not in ticket.failover:  # its earlier try's admissions all settled
            ticket.failover.append("edge:admitted_anew")
        if plan.fallback_from is not None:
            ticket.failover.append(f"fallback_from:{plan.fallback_from}")
        if early is not None:
            self.telemetry.started_early(model, "admitted")
        self.telemetry.admitted(record)
        if plan.op.carries_request_id:
            plan.sets.request_id = ticket.request_id
        if early is None:
            # Again: requests that arrived together all passed the first look while Redis
            # admitted them. Nothing yields from here until _hand_on counts this one as
            # waiting, so no more than the bound queue (an early start is already sent).
            queue_full = self._queue_full(model, queue_limit)
        if queue_full:
            # This tier's share of the model's queue is full (the rest is kept for higher tiers).
            self.access.settle(ticket, "overloaded", Usage())
            raise _unavailable(
                ticket,
                f"Model '{model}' is at capacity for {plan.tier}-priority requests. Please retry shortly.",
                "model_overloaded",
            )
        return ticket, early

    async def _call(self, plan: _Plan, ticket: Ticket, record: RequestRecord, early: _EarlyStart | None) -> Reply:
        """The call to one of the model's replicas, streamed or whole, under the
        request's one admission. A replica that fails it before its first byte (died,
        draining, a 5xx of its engine, a stream stalled past ``first_token_timeout_s``)
        is counted against it (routing/outliers.py) and the request is sent again to
        another replica, up to ``failover.retries`` times: nothing was relayed, and a
        replica call has no side effect but its engine's work, which is not charged.
        What the cluster or the transport raises otherwise is answered here, and
        settled: nothing is charged for what never ran."""
        model = plan.model
        for attempt in range(plan.config.failover.retries + 1):
            try:
                return await self._try_replica(plan, ticket, record, early)
            except _FailedBeforeFirstByte as failed:
                if not failed.replica and attempt == 0:  # a direct route's in-process replica: this one
                    failed.replica = self.own_replica
                early = None  # a try again takes the ordinary path
                ticket.failover.append(f"{failed.replica or 'unknown'}:{failed.reason}")
                if self._ejector(plan).failed(failed.replica):
                    self.telemetry.replica_ejected(model)
                if failed.reason == "stalled":
                    self.telemetry.stream_stalled(model)
                if attempt == plan.config.failover.retries:
                    error = self._failed_error(ticket, failed)
                    if failed.refused is None or failed.refused.status == 503:  # no replica could: a fallback may
                        await self._cannot_serve(plan, ticket, error)
                    self.access.settle(ticket, "failed", Usage(), failed.replica)
                    raise error from None
                self.telemetry.retried(model, failed.reason)
                if ticket.on_settle is not None:  # its fair-share place: the try again takes one anew
                    ticket.on_settle()
                    ticket.on_settle = None
                avoid = plan.avoid if not failed.replica else (*plan.avoid, failed.replica)
                plan = dataclasses.replace(plan, avoid=avoid, handle=self._elsewhere(plan))
        raise AssertionError("unreachable")

    def _failed_error(self, ticket: Ticket, failed: _FailedBeforeFirstByte) -> OpenAIError:
        """The client's answer when the last try failed as ``failed``."""
        if failed.refused is not None:
            return _engine_error(ticket, failed.refused)
        if failed.reason == "stalled":
            return _unavailable(
                ticket, f"A replica of model '{ticket.model}' sent nothing in time. Please retry.", "replica_stalled"
            )
        return _unavailable(
            ticket, f"A replica of model '{ticket.model}' went away. Please retry.", "replica_unavailable"
        )

    async def _cannot_serve(self, plan: _Plan, ticket: Ticket, error: OpenAIError) -> None:
        """No replica of the model can take it: with fallbacks, its admission is withdrawn
        (as if never made) and ``run`` tries them; without, nothing happens here."""
        if plan.may_fall_back:
            await self.access.withdraw(ticket)
            raise _NoReplicaCanServe(error, plan)

    async def _try_replica(
        self, plan: _Plan, ticket: Ticket, record: RequestRecord, early: _EarlyStart | None
    ) -> Reply:
        """One try of ``_call``: raises ``_FailedBeforeFirstByte`` unsettled, settles the rest."""
        model, queue_timeout_s = plan.model, plan.config.queue_timeout_s
        try:
            if plan.streaming:
                return await self._call_streamed(plan, ticket, record, early)
            answer = await self._call_unary(plan, ticket, record.trace)
        except (OpenAIError, _FailedBeforeFirstByte) as exc:
            if isinstance(exc, OpenAIError):
                exc.headers = {**ticket.headers, **exc.headers}
            raise
        except _PromptOverReservation:
            raise  # settled where it was answered; run() admits it again at its real size
        except BackPressureError:
            # The cluster is full, not the key's quota: nothing ran, nothing is charged.
            error = _unavailable(ticket, f"Model '{model}' is at capacity. Please retry shortly.", "model_overloaded")
            await self._cannot_serve(plan, ticket, error)
            self.access.settle(ticket, "overloaded", Usage())
            raise error from None
        except QueueTimeout:
            # Still queued after the model's bound: replicas busy or starting (scale from zero).
            message = (
                f"No replica of model '{model}' became available within {queue_timeout_s:g}s (it may be starting). "
                "Please retry."
            )
            error = _unavailable(ticket, message, "model_unavailable")
            await self._cannot_serve(plan, ticket, error)
            self.access.settle(ticket, "overloaded", Usage())
            raise error from None
        except (RayActorError, ActorUnavailableError):
            raise _FailedBeforeFirstByte("died", "") from None  # Serve itself drops a dead replica
        except RequestCancelledError if ticket.revoked else ():  # noqa: B030 (only a revoked ticket's cancellation)
            # A cancelled call returns nothing, so what the engine generated before the
            # cut is not known here: the key is charged its prompt, never its reservation.
            self.access.settle(ticket, "failed", Usage(prompt_tokens=plan.reservation.prompt))
            raise OpenAIError(
                401,
                "This API key (or its team) was revoked or disabled while the request ran.",
                type="authentication_error",
                code="invalid_api_key",
                headers=ticket.headers,
            ) from None
        except Exception:
            # The call failed between ingress and replica (the transport refused a
            # message, the replica raised): nothing reached the client, nothing is charged.
            logger.exception("model %s: the call to its replica failed", model)
            self.access.settle(ticket, "failed", Usage())
            raise OpenAIError(
                502,
                f"The call to a replica of model '{model}' failed. Please retry.",
                code="replica_call_failed",
                headers={**ticket.headers, **RETRY_HEADERS},
            ) from None
        except BaseException:  # cancelled (the client left): the engine may have generated, the reservation holds
            self.access.settle(ticket, "failed")
            raise
        self.catalog.describe_while_up(model)
        if isinstance(answer, ReplicaError):
            raise await self._replica_refused(ticket, answer)
        self._ejector(plan).succeeded(answer.replica)
        self._served(model, ticket.key.id, answer.usage)  # before its place goes to the next one
        self.access.settle(ticket, "completed", answer.usage or Usage(), answer.replica)
        record.used(answer.usage)
        return Reply(self._answer_headers(plan, ticket), body=answer.body)

    def _answer_headers(self, plan: _Plan, ticket: Ticket) -> dict[str, str]:
        if plan.fallback_from is None:
            return ticket.headers
        return {**ticket.headers, FALLBACK_FROM_HEADER: plan.fallback_from}

    def _ejector(self, plan: _Plan) -> OutlierEjector:
        return self._ejectors[plan.model]

    def _elsewhere(self, plan: _Plan):
        """The handle a try again goes by: the model's own (its router leaves out the
        replicas in ``avoid``), or from a direct route's in-process replica, a real handle
        to its deployment (the replica hands the request on to another of its model)."""
        handle = self.elsewhere.get(plan.model)
        if handle is None:
            return plan.handle
        if plan.adapter is not None:
            handle = handle.options(multiplexed_model_id=plan.adapter)
        if plan.routing_session:
            handle = handle.options(session_id=plan.routing_session)
        return handle

    async def _call_unary(
        self, plan: _Plan, ticket: Ticket, trace: RequestTrace | None
    ) -> ReplicaAnswer | ReplicaError:
        """A unary call travels as a stream of one item: over Serve's gRPC transport a
        unary call is known to be with a replica only once it has ended, so the queue
        timeout would bound the whole call and a cancel would never reach the replica."""
        op, body, handle = plan.op, replica_body(plan.body, plan.sets), plan.handle
        context = replica_context(trace, plan.model)
        response = await self._hand_on(
            plan.model,
            ticket,
            lambda: handle.options(stream=True).call_streamed.remote(
                op.replica_operation,
                body,
                trace=context,
                prompt_allowance=plan.reservation.prompt_allowance,
                **plan.avoiding(),
            ),
            plan.config.queue_timeout_s,
            plan.rank,
            trace=trace,
        )
        replica = outliers.replica_of(assigned_call(response))
        # Its key revoked or disabled while it runs (Maintenance.stop_revoked): the call is
        # cancelled, and the engine aborts it, as a stream's relay ends at its next item.
        ticket.on_revoke = response.cancel
        if ticket.revoked:
            response.cancel()
        try:
            return await only_item(response)
        except (RayActorError, ActorUnavailableError):
            raise _FailedBeforeFirstByte("died", replica) from None

    async def _call_streamed(
        self, plan: _Plan, ticket: Ticket, record: RequestRecord, early: _EarlyStart | None
    ) -> Reply:
        """The call to a replica, relayed as it streams; the relay settles it."""
        op, handle, request, model = plan.op, plan.handle, plan.request, plan.model
        queue_timeout_s, rank, reservation = plan.config.queue_timeout_s, plan.rank, plan.reservation
        options = getattr(request, "stream_options", None)
        client_wants_usage = bool(options and options.include_usage)
        trace = record.trace
        if early is None:
            body = replica_body(plan.body, _asking_for_usage(op, plan.sets))
            context = replica_context(trace, model)
            chunks = await self._hand_on(
                model,
                ticket,
                lambda: handle.options(stream=True).stream.remote(
                    op.replica_operation,
                    body,
                    trace=context,
                    prompt_allowance=reservation.prompt_allowance,
                    **plan.avoiding(),
                ),
                queue_timeout_s,
                rank,
                trace=trace,
            )
            next_item = chunks.__anext__()
        else:
            try:
                chunks = await self._hand_on(
                    model, ticket, lambda: early.chunks, queue_timeout_s, rank, early.place, trace
                )
            except BaseException:
                early.withdraw()
                raise
            next_item = early.first
        replica = outliers.replica_of(assigned_call(chunks))
        try:
            async with asyncio.timeout(plan.config.failover.first_token_timeout_s):
                first = await next_item
        except StopAsyncIteration:
            self.access.settle(ticket, "failed")
            raise OpenAIError(500, "The model returned an empty stream.") from None
        except TimeoutError:
            # Nothing from its replica in time: the call is ended (its engine aborts the
            # request) and it goes to another replica.
            chunks.cancel()
            raise _FailedBeforeFirstByte("stalled", replica) from None
        except (RayActorError, ActorUnavailableError):
            raise _FailedBeforeFirstByte("died", replica) from None
        if isinstance(first, ReplicaError):
            raise await self._replica_refused(ticket, first)
        self._ejector(plan).succeeded(first.replica)
        record.first_token_at = time.monotonic()
        record.stream = True
        if trace is not None:
            trace.first_token()
        self.catalog.describe_while_up(model)
        relay = relay_stream(
            first,
            chunks,
            ticket,
            client_wants_usage,
            record,
            reservation,
            op.name == "chat",
            STREAM_SHAPES[op.streams_as],
            access=self.access,
            telemetry=self.telemetry,
            served=self._served,
        )
        # A client that hangs up before the first byte is sent never starts the
        # relay, so its `finally` never runs: settle when the unstarted relay is dropped
        # (otherwise its lease would be renewed for as long as the ingress lives).
        weakref.finalize(relay, self._dropped_unstarted, ticket, chunks, record)
        return Reply(self._answer_headers(plan, ticket), stream=relay)

    async def _replica_refused(self, ticket: Ticket, refused: ReplicaError) -> Exception:
        """Settle a request the replica refused before running it; the exception to raise.
        A prompt larger than its reservation is not the client's error: its admission is
        withdrawn (its reservation and record; its request of requests/min stays charged,
        since the replica rendered it) and ``run`` admits it again at the size the replica
        counted, not charging requests/min again."""
        prompt_tokens = refused.prompt_over_allowance
        if prompt_tokens is not None:
            await self.access.withdraw(ticket, keep_request=True)  # a render is a request
            return _PromptOverReservation(prompt_tokens)
        if refused.status >= 500:  # the replica's fault, not the request's: another may serve it
            return _FailedBeforeFirstByte("answered_5xx", refused.replica, refused)
        self.access.settle(ticket, "failed", Usage(), refused.replica)
        return _engine_error(ticket, refused)

    def _start_early(
        self, plan: _Plan, key: KeyRecord, record: RequestRecord, edge_id: str | None
    ) -> _EarlyStart | None:
        """Send a stream to ``model``'s replicas before its admission, if its key may
        (``Gatekeeper.may_start_before_admission``), the fair-share queue has a place at
        once and the model is busy or ``start_early_when_idle``; else None, and the
        request takes the ordinary path. Sent under ``edge_id`` when the edge named the
        request (a try again then takes over its first's admission), else a new id.

        On a busy model the admission's round trip waits behind the other requests'
        work (measured on the 2-core box: 300 ms at worst while a stream ran beside
        it) and the new request would queue for the engine's next step anyway. On an
        idle model it is one round trip (p50 0.8 ms at c=1 here) that an early start
        takes out of the time to first token (c=1 TTFT p50 about 1 ms lower, docs/performance.md),
        as long as Redis gets a core while the engine computes: a Redis
        in the normal class on the engine's cores answered in ~100 ms (measured), so
        ``quota.overlap_admission_when_idle`` can turn it off. Without it, admissions
        under way count as busy for a burst on an idle model (a round of clients whose
        streams ended together): its first request is admitted first, the others
        start at once rather than each waiting for Redis."""
        op, model, reservation = plan.op, plan.model, plan.reservation
        busy = self.telemetry.in_flight_count(model) or self._admitting[model]
        if not (busy or self.start_early_when_idle):
            return None
        if not self.access.may_start_before_admission(key, reservation.tokens):
            return None
        place = None
        gate = self._gates.get(model)
        if gate is not None:
            place = gate.enter_now(key.id)
            if place is None:
                return None
        request_id = edge_id or new_request_id(key.id)
        if op.carries_request_id:
            plan.sets.request_id = request_id
        context = replica_context(record.trace, model)
        chunks: Any = plan.handle.options(stream=True).stream.remote(  # a stream: a response generator
            op.replica_operation,
            replica_body(plan.body, _asking_for_usage(op, plan.sets)),
            trace=context,
            prompt_allowance=reservation.prompt_allowance,
        )
        # Pulling the first item is what starts an in-process replica's engine
        # request (a handle's call is already on its way to a replica).
        return _EarlyStart(request_id, chunks, asyncio.ensure_future(chunks.__anext__()), place)

    def _queue_full(self, model: str, limit: int) -> bool:
        """Whether ``model``'s queue holds ``limit`` waiting requests (a negative limit: unbounded)."""
        return 0 <= limit <= self._waiting[model]

    async def _hand_on(
        self,
        model: str,
        ticket: Ticket,
        send,
        timeout_s: float,
        rank: int,
        place=None,
        trace: RequestTrace | None = None,
    ):
        """``send()`` the request to ``model``'s replicas once the fair-share queue gives
        it a place (at once while the model has room) and wait until a replica takes
        it. The model's queue timeout bounds both waits: past it the call is withdrawn
        and ``QueueTimeout`` raised. Meanwhile the request counts as waiting. Its
        place (``place`` when it already has one) is freed when its ticket is
        settled, whatever way the request ends."""
        gate = self._gates.get(model)
        if place is not None:
            ticket.on_settle = place.leave
            gate = None

        async def take_a_place() -> None:
            assert gate is not None  # only passed when there is a gate
            place = await gate.enter(ticket.key.id, rank)
            ticket.on_settle = place.leave

        self._waiting[model] += 1
        started = now_ns()
        try:
            response = await reach_replica(send, timeout_s, take_a_place if gate is not None else None)
        finally:
            self._waiting[model] -= 1
        if trace is not None:  # the fair-share queue's wait and Serve's, until a replica took it
            trace.stage("queue", started, **{"llm.fair_share": gate is not None})
        return response

    def _served(self, model: str, key_id: str, usage: Usage | None) -> None:
        """What the request used, charged to its key's fair-share counter."""
        gate = self._gates.get(model)
        if gate is not None and usage is not None:
            gate.served(key_id, usage.prompt_tokens, usage.completion_tokens)

    def _dropped_unstarted(self, ticket: Ticket, chunks, record: RequestRecord) -> None:
        if ticket.settled:
            return
        try:
            chunks.cancel()
            self.access.settle(ticket, "cancelled")
            record.status, record.cancelled = 499, True
            self.telemetry.finish(record)
        except RuntimeError:  # no running loop: the process is ending, its leases expire
            pass


def _asking_for_usage(op: Operation, sets: GatewayFields) -> GatewayFields:
    """A stream's fields: usage is always asked for, as it settles the token
    reservation. (Anthropic's streams always carry it.)"""
    return dataclasses.replace(sets, include_usage=op.streams_as == "openai")


@dataclass
class _Plan:
    """A request checked and priced, before its admission: what the later stages use."""

    op: Operation
    request: Any  # the validated request (api_requests' model of it)
    body: dict[str, Any]  # the client's canonical body (the replica gets it with ``sets``)
    model: str
    handle: DeploymentHandle  # the model's (with its adapter, if one is named)
    config: ModelConfig
    reservation: Reservation
    rank: int  # its place in the engine's priority and the fair-share queue's order
    tier: PriorityTier  # whose share of the model's queue it may take
    sets: GatewayFields  # what the gateway sets on its call (replica_request.py)
    streaming: bool
    client_salt: str | None = None  # the client's own cache_salt (it divides its tenant's cache)
    cache_key: str | None = None  # OpenAI's prompt_cache_key: a routing hint within the tenant
    session: str | None = None  # the client's session header
    rendered: bool = False  # the replica rendered it once: its request of requests/min is paid
    adapter: str | None = None  # the LoRA adapter it names (Serve multiplexing)
    routing_session: str | None = None  # the session its router places it by (within its tenant)
    avoid: tuple[str, ...] = ()  # replicas that failed it already: its router leaves them out
    fallback_from: str | None = None  # the model the client named, when this is its fallback
    may_fall_back: bool = False  # a model to try after this one (``run``)

    def body_for(self, model: str) -> dict[str, Any]:
        """The client's body (as planned, its stored conversation included) naming
        ``model``, with what planning took out of it put back."""
        taken = {"prompt_cache_key": self.cache_key, "cache_salt": self.client_salt}
        # A new client body, as the client would have sent it (the gateway's fields are
        # written on the way to the replica, replica_request.py, as for any request).
        return {
            **copy.deepcopy(self.body),
            "model": model,
            **{name: value for name, value in taken.items() if value is not None},
        }

    def avoiding(self) -> dict[str, tuple[str, ...]]:
        """The replica call's keyword naming the replicas its router leaves out (none: no keyword)."""
        return {AVOID: self.avoid} if self.avoid else {}

    def resized(self, prompt_tokens: int) -> _Plan:
        """The same request, its prompt reserved as the replica counted it; its
        requests/min paid by the admission under which the replica rendered it."""
        return dataclasses.replace(self, reservation=self.reservation.resized(prompt_tokens), rendered=True)


class _EarlyStart:
    """A stream sent before its admission: its request id, the call, the task
    pulling its first item, and its fair-share place (None without a gate)."""

    __slots__ = ("request_id", "chunks", "first", "place")

    def __init__(self, request_id: str, chunks, first: asyncio.Future, place):
        self.request_id, self.chunks, self.first, self.place = request_id, chunks, first, place

    def withdraw(self) -> None:
        """Not admitted (or the client left): end the call, whose engine request
        vLLM aborts, and give its place back."""
        if self.first.done():
            if not self.first.cancelled():
                self.first.exception()  # retrieved: it is not an error of anyone's
        else:
            self.first.cancel()  # an in-process replica's generator ends where it waits
        self.chunks.cancel()
        if self.place is not None:
            self.place.leave()
