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
import logging
import re
import time
import weakref
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, RequestCancelledError
from ray.serve.handle import DeploymentHandle

from contract.model_config import ADAPTER_NAME, VLLM_PRIORITY, ModelConfig, deployment_name
from contract.replica_wire import ReplicaAnswer, ReplicaError, StreamStart, Usage
from serve_app.quota.access import Access, Ticket
from serve_app.wire.api_requests import OPERATIONS, Operation, validate_request
from serve_app.wire.calls import Reply
from serve_app.errors import RETRY_HEADERS, OpenAIError, from_engine_error
from serve_app.pipeline.fair_share import FairGate, TokenWeights, VirtualTokenCounter, replica_places
from serve_app.quota.keys import KeyRecord
from serve_app.wire.media import check_media
from serve_app.wire.parameters import apply_parameter_policy
from serve_app.wire.reservation import Reservation, reserve
from serve_app.wire.sse import STREAM_SHAPES, StreamShape
from serve_app.telemetry import RequestRecord, Telemetry
from serve_app.quota.usage import new_request_id

logger = logging.getLogger("ray.serve")

STREAM_FAILED = (
    'data: {"error": {"message": "The model stream failed.", "type": "server_error", '
    '"param": null, "code": null}}\n\n'
)
KEY_REVOKED = (
    'data: {"error": {"message": "This API key was revoked or disabled while the stream ran.", '
    '"type": "authentication_error", "param": null, "code": "invalid_api_key"}}\n\n'
)


def _unavailable(ticket: Ticket, message: str, code: str) -> OpenAIError:
    """503, never 429: the cluster is busy, the key's quota is fine."""
    return OpenAIError(503, message, code=code, headers={**ticket.headers, **RETRY_HEADERS})


def _engine_error(ticket: Ticket, refused: ReplicaError) -> OpenAIError:
    """An error the replica answered; its 503 (engine gone) tells when to retry."""
    exc = from_engine_error(refused.status, refused.error)
    exc.headers = {**ticket.headers, **(RETRY_HEADERS if refused.status == 503 else {})}
    return exc


# Operations whose engine requests carry the key's tier as vLLM's `priority`.
PRIORITIZED = frozenset({"chat", "completions", "responses"})
# The rank of batch requests (``run(background=True)``): after every key's tier, in
# the engine (vLLM's priority), the fair-share gate and the model's queue.
BACKGROUND_RANK = len(VLLM_PRIORITY)


class KeyRevoked(Exception):
    """The key of a running stream was revoked or disabled."""


class QueueTimeout(Exception):
    """No replica took the request within the model's ``queue_timeout_s``."""


async def reach_replica(send, timeout_s: float, before=None):
    """``send()`` a call (unary or streaming) and wait until Serve has handed it to
    a replica: immediate when one has room, longer while all are busy or the model
    is scaling up from zero. ``before()``, when given, is awaited first within the
    same bound (the fair-share gate). Past ``timeout_s`` the call is withdrawn and
    ``QueueTimeout`` raised; else the call is returned. Serve has no public hook for
    "assigned"; its responses await this private coroutine first (pinned by the
    scale-to-zero end-to-end test)."""
    response = None
    try:
        async with asyncio.timeout(timeout_s):  # no extra task per request, unlike wait_for
            if before is not None:
                await before()
            response = send()
            await response._fetch_future_result_async()
    except TimeoutError:
        if response is not None:
            response.cancel()
        raise QueueTimeout from None
    return response


async def _only_item(response):
    """The one item of a unary call's stream, read to its end (Serve counts the call
    done only then)."""
    items = [item async for item in response]
    if len(items) != 1:
        raise RuntimeError(f"a unary call answered {len(items)} items")
    return items[0]


def _fair_gate(config: ModelConfig) -> FairGate:
    share = config.fair_share
    weights = TokenWeights(prompt=share.prompt_weight, completion=share.completion_weight)
    deployment = deployment_name(config.name)
    return FairGate(lambda: replica_places(deployment), VirtualTokenCounter(weights), share.light_key_places)


class Gateway:
    def __init__(
        self,
        access: Access,
        models: dict[str, DeploymentHandle],
        configs: list[ModelConfig],
        telemetry: Telemetry,
        describers: dict[str, DeploymentHandle] | None = None,
        start_early: bool = False,
        start_early_when_idle: bool = False,
    ):
        self.access = access
        # Whether a stream may start before its admission (``_start_early``): a model's
        # direct route only, whose replica is in-process. Through the ingress an early
        # call would sit in Serve's queue uncounted by the tiers' queue shares and the
        # fair-share gate while its admission runs (tests/e2e/test_scheduling_e2e.py).
        self.start_early = start_early
        # And on an idle model too (``quota.overlap_admission_when_idle``), not only while it is busy.
        self.start_early_when_idle = start_early_when_idle
        self.telemetry = telemetry
        self.models = models
        # Handles for the gateway's own calls to a model (its description). The
        # ingress gives each model one apart from ``models``: a router of its own,
        # so a description waiting behind a busy replica never holds a slot of the
        # queue clients are admitted to (a queue of one refused a client for it).
        self._describers = describers if describers is not None else models
        self._configs = {config.name: config for config in configs}
        # Requests of each model waiting for a replica at this ingress (Serve's
        # queue for it here): the priority tiers' queue shares are measured on it.
        self._waiting = {config.name: 0 for config in configs}
        # Requests of each model whose admission is in Redis now (busy, for ``_start_early``).
        self._admitting = {config.name: 0 for config in configs}
        # Fair share between keys while a model's replicas are all busy (fair_share.py).
        self._gates = {config.name: _fair_gate(config) for config in configs if config.fair_share.enabled}
        self._created = int(time.time())
        self._card_details: dict[str, dict[str, Any]] = {}
        self._describing: dict[str, asyncio.Future] = {}
        # What clients may send as `model`: each configured name and its aliases.
        self._names = {config.name: config.name for config in configs}
        self._names.update({alias: config.name for config in configs for alias in config.aliases})
        # Configured LoRA adapter names -> their base model.
        self._adapters = {
            adapter: config.name for config in configs if config.lora for adapter in config.lora.adapters
        }

    # -- models ----------------------------------------------------------------

    def resolve(self, model: str) -> str:
        """The configured name behind ``model`` (a name, alias or adapter), or 404."""
        return self.target(model)[0]

    def authorized(self, key: KeyRecord, model: str) -> str:
        """The configured name behind ``model`` when ``key`` may use it; else a 404 or 403."""
        name = self.resolve(model)
        self.access.authorize(key, name)
        return name

    def target(self, model: str) -> tuple[str, str | None]:
        """(configured model, LoRA adapter or None) for what a client sent as
        ``model``: a name, an alias, a configured adapter name, or
        '<model>:<adapter folder>' for a model with an adapter folder. 404 otherwise."""
        name = self._names.get(model)
        if name is not None:
            return name, None
        base = self._adapters.get(model)
        if base is None:
            base, _, folder = model.partition(":")
            lora = self._configs[base].lora if base in self._configs else None
            if lora is None or lora.dir is None or not re.fullmatch(ADAPTER_NAME, folder):
                raise OpenAIError(
                    404,
                    f"The model '{model}' does not exist or you do not have access to it.",
                    param="model",
                    code="model_not_found",
                )
        return base, model

    async def model_card(self, model: str) -> dict[str, Any]:
        """OpenAI's model object plus what vLLM reports (``max_model_len``, the
        operations it serves). The details come from a replica once, then stay
        cached: they are fixed by the model's config. An alias's card names the
        model it stands for in ``alias_of``, an adapter's its base in ``parent``
        (vLLM's field for it). A scale-to-zero model is never woken up to be
        described: its card has the details once one of its replicas served."""
        name, _ = self.target(model)
        if name not in self._card_details and not self._configs[name].scales_to_zero:
            await self._details_within_queue_timeout(name)
        return self._card(model)

    def _card(self, model: str) -> dict[str, Any]:
        """``model``'s card with what is known of it now."""
        name, adapter = self.target(model)
        card = {
            "id": name,
            "object": "model",
            "created": self._created,
            "owned_by": self._configs[name].owned_by,
            **self._card_details.get(name, {}),
        }
        if adapter is not None:
            card.update(id=model, parent=name)
        elif model != name:
            card.update(id=model, alias_of=name)
        return card

    async def _details_within_queue_timeout(self, name: str) -> None:
        """Learn ``name``'s details, waiting at most its queue timeout (its replicas
        may all be busy or still loading); every caller waits on one replica call.
        Past the bound the card goes without them: the next one tries again."""
        try:
            await asyncio.wait_for(asyncio.shield(self._describing_task(name)), self._configs[name].queue_timeout_s)
        except TimeoutError:
            logger.warning("model %s: no replica described it within its queue timeout", name)

    async def _learn_details(self, name: str) -> None:
        try:
            describe = self._describers[name].model_info.remote
            response = await reach_replica(describe, self._configs[name].queue_timeout_s)
            info = await response
        except QueueTimeout:
            return  # withdrawn: the next card or request tries again
        except Exception:
            logger.exception("could not describe model %s", name)
            return
        self._card_details[name] = {"max_model_len": info["max_model_len"], "capabilities": info["operations"]}

    def context_length(self, name: str) -> int | None:
        """The model's context length: what its replica reported, else its
        configured ``max_model_len``; None while neither is known."""
        learnt = self._card_details.get(name, {}).get("max_model_len")
        return learnt or self._configs[name].engine_kwargs.get("max_model_len")

    def _describe_while_up(self, name: str) -> None:
        """A scale-to-zero model just answered, so a replica is up: learn its
        card details now, off the request's path."""
        if name not in self._card_details:
            self._describing_task(name)

    def described(self, name: str) -> bool:
        """Whether a replica of ``name`` has answered (with its details); if not,
        ask one now, off the caller's path (readiness probes poll this)."""
        if name in self._card_details:
            return True
        self._describing_task(name)
        return False

    def _describing_task(self, name: str) -> asyncio.Future:
        """The one running ``_learn_details(name)``, started if none runs."""
        if name not in self._describing:
            task = asyncio.ensure_future(self._learn_details(name))
            self._describing[name] = task  # a reference, or the loop may drop the task
            task.add_done_callback(lambda _: self._describing.pop(name, None))
        return self._describing[name]

    async def only_model_for(self, operation: str | None) -> str:
        """The model for a request that names none (platforms such as SageMaker
        or Azure serve one model per endpoint): the only one serving
        ``operation`` (any operation when None), else a 400 asking for it."""
        if operation is not None:  # what each serves: every model described side by side
            await asyncio.gather(*(
                self._details_within_queue_timeout(name)
                for name, config in self._configs.items()
                if name not in self._card_details and not config.scales_to_zero
            ))
        names = [
            name
            for name in self._configs
            # A model not described (yet: scaled to zero, or busy past its queue timeout) may serve it.
            if operation is None or operation in self._card_details.get(name, {}).get("capabilities", [operation])
        ]
        if len(names) == 1:
            return names[0]
        raise OpenAIError(
            400,
            f"Missing required parameter: 'model'. This endpoint serves {', '.join(names) or 'no model for this operation'}.",
            param="model",
            code="missing_required_parameter",
        )

    async def model_cards(self, key: KeyRecord) -> list[dict[str, Any]]:
        """Every model ``key`` may use, each followed by its aliases and its
        configured adapters (adapters in a folder are loaded on demand, not listed).
        Models are described side by side: the list waits one queue timeout at most."""
        await asyncio.gather(*(
            self._details_within_queue_timeout(name)
            for name, config in self._configs.items()
            if key.allows_model(name) and name not in self._card_details and not config.scales_to_zero
        ))
        return [
            self._card(model)
            for name, config in self._configs.items()
            if key.allows_model(name)
            for model in (name, *config.aliases, *(config.lora.adapters if config.lora else ()))
        ]

    # -- requests --------------------------------------------------------------

    def waiting(self, model: str) -> int:
        """Requests of ``model`` waiting for a replica at this ingress."""
        return self._waiting.get(model, 0)

    async def run(
        self, key: KeyRecord, operation: str | Operation, body: dict[str, Any], raw_size: int, record: RequestRecord,
        background: bool = False,
    ) -> Reply:
        """Admit ``body`` for ``key`` and answer it. Raises ``OpenAIError``.
        ``record`` learns what telemetry needs; a streamed reply finishes it
        when the stream ends, anything else is finished by the caller.
        ``background`` (batches): ranked after every tier, and refused when the
        model's queue is as full as the low tier's share."""
        op = OPERATIONS[operation] if isinstance(operation, str) else operation
        record.operation = op.name
        request = validate_request(op, body)
        apply_parameter_policy(op.name, body)
        model, adapter = self.target(request.model)
        record.model = model
        body["model"] = model  # the name vLLM serves it under; the replica names an adapter itself
        handle = self.models[model]
        if adapter is not None:
            # Serve model multiplexing: prefer replicas that already hold the adapter.
            handle = handle.options(multiplexed_model_id=adapter)
        self.access.authorize(key, model)
        # Chat, Anthropic messages, embeddings of chat-shaped input (vLLM's multimodal
        # embeddings), and the Responses API's input items (messages with content parts).
        check_media(body.get("input") if op.name == "responses" else body.get("messages"), self._configs[model].media)
        reservation = reserve(
            op.name,
            body,
            raw_size,
            default_max_tokens=self.access.default_max_tokens,
            context_length=self.context_length(model),
        )
        config = self._configs[model]
        rank = BACKGROUND_RANK if background else VLLM_PRIORITY[key.priority]
        if config.priority_scheduling and op.name in PRIORITIZED:
            body["priority"] = rank
        tier = "low" if background else key.priority
        queue_limit = config.priority.queue_limit(tier, config.max_queued_requests)
        queue_full = self._queue_full(model, queue_limit)
        streaming = bool(getattr(request, "stream", False))
        # A stream of a key with room to spare starts in the engine now, its
        # admission beside the prefill (serve_app/quota/overlap.py); nothing is relayed
        # before Redis admits it.
        early = (self._start_early(handle, op, body, key, model, reservation)
                 if self.start_early and streaming and not queue_full else None)
        self._admitting[model] += 1
        try:
            ticket = await self.access.admit(
                key,
                model,
                reservation.tokens,
                # Ray Serve's id for this HTTP request: it answers it as x-request-id.
                record.request_id,
                request_id=early.request_id if early else None,
            )
        except BaseException:
            if early is not None:
                early.withdraw()  # refused, or the client left: the engine aborts it
                self.telemetry.started_early(model, "withdrawn")
            raise
        finally:
            self._admitting[model] -= 1
        if early is not None:
            self.telemetry.started_early(model, "admitted")
        self.telemetry.admitted(record)
        if op.carries_request_id:
            body["request_id"] = ticket.request_id
        if early is None:
            # Again: requests that arrived together all passed the first look while Redis
            # admitted them. Nothing yields from here until _hand_on counts this one as
            # waiting, so no more than the bound queue (an early start is already sent).
            queue_full = self._queue_full(model, queue_limit)
        if queue_full:
            # This tier's share of the model's queue is full (the rest is kept for higher tiers).
            self.access.settle(ticket, "overloaded", Usage())
            raise _unavailable(ticket, f"Model '{model}' is at capacity for {tier}-priority requests. "
                                       "Please retry shortly.", "model_overloaded")
        queue_timeout_s = config.queue_timeout_s
        try:
            if streaming:
                return await self._stream(handle, op, body, request, ticket, queue_timeout_s, record, reservation, rank,
                                          early)
            # A unary call travels as a stream of one item: over Serve's gRPC transport a
            # unary call is known to be with a replica only once it has ended, so the queue
            # timeout would bound the whole call and a cancel would never reach the replica.
            response = await self._hand_on(
                model, ticket, lambda: handle.options(stream=True).call_streamed.remote(op.replica_operation, body),
                queue_timeout_s, rank)
            # Its key revoked or disabled while it runs (Access.stop_revoked): the call is
            # cancelled, and the engine aborts it, as a stream's relay ends at its next item.
            ticket.on_revoke = response.cancel
            if ticket.revoked:
                response.cancel()
            answer: ReplicaAnswer | ReplicaError = await _only_item(response)
        except OpenAIError as exc:
            exc.headers = {**ticket.headers, **exc.headers}
            raise
        except BackPressureError:
            # The cluster is full, not the key's quota: nothing ran, nothing is charged.
            self.access.settle(ticket, "overloaded", Usage())
            raise _unavailable(ticket, f"Model '{model}' is at capacity. Please retry shortly.", "model_overloaded") from None
        except QueueTimeout:
            # Still queued after the model's bound: replicas busy or starting (scale from zero).
            self.access.settle(ticket, "overloaded", Usage())
            message = f"No replica of model '{model}' became available within {queue_timeout_s:g}s (it may be starting). Please retry."
            raise _unavailable(ticket, message, "model_unavailable") from None
        except (RayActorError, ActorUnavailableError):
            self.access.settle(ticket, "failed", Usage())
            raise _unavailable(ticket, f"A replica of model '{model}' went away. Please retry.", "replica_unavailable") from None
        except RequestCancelledError if ticket.revoked else ():
            # A cancelled call returns nothing, so what the engine generated before the
            # cut is not known here: the key is charged its prompt, never its reservation.
            self.access.settle(ticket, "failed", Usage(prompt_tokens=reservation.prompt))
            raise OpenAIError(401, "This API key was revoked or disabled while the request ran.",
                              type="authentication_error", code="invalid_api_key", headers=ticket.headers) from None
        except Exception:
            # The call failed between ingress and replica (the transport refused a
            # message, the replica raised): nothing reached the client, nothing is charged.
            logger.exception("model %s: the call to its replica failed", model)
            self.access.settle(ticket, "failed", Usage())
            raise OpenAIError(502, f"The call to a replica of model '{model}' failed. Please retry.",
                              code="replica_call_failed", headers={**ticket.headers, **RETRY_HEADERS}) from None
        except BaseException:  # cancelled (the client left): the engine may have generated, the reservation holds
            self.access.settle(ticket, "failed")
            raise
        self._describe_while_up(model)
        if isinstance(answer, ReplicaError):
            self.access.settle(ticket, "failed", Usage(), answer.replica)
            raise _engine_error(ticket, answer)
        self._served(model, key.id, answer.usage)  # before its place goes to the next one
        self.access.settle(ticket, "completed", answer.usage or Usage(), answer.replica)
        record.used(answer.usage)
        return Reply(ticket.headers, body=answer.body)

    async def _stream(
        self,
        handle: DeploymentHandle,
        op: Operation,
        body: dict,
        request,
        ticket: Ticket,
        queue_timeout_s: float,
        record: RequestRecord,
        reservation: Reservation,
        rank: int,
        early: "_EarlyStart | None" = None,
    ) -> Reply:
        options = getattr(request, "stream_options", None)
        client_wants_usage = bool(options and options.include_usage)
        if early is None:
            _ask_for_usage(op, body)
            chunks = await self._hand_on(
                body["model"], ticket, lambda: handle.options(stream=True).stream.remote(op.replica_operation, body),
                queue_timeout_s, rank)
            next_item = chunks.__anext__()
        else:
            try:
                chunks = await self._hand_on(body["model"], ticket, lambda: early.chunks, queue_timeout_s, rank,
                                             early.place)
            except BaseException:
                early.withdraw()
                raise
            next_item = early.first
        try:
            first = await next_item
        except StopAsyncIteration:
            self.access.settle(ticket, "failed")
            raise OpenAIError(500, "The model returned an empty stream.") from None
        if isinstance(first, ReplicaError):
            self.access.settle(ticket, "failed", Usage(), first.replica)
            raise _engine_error(ticket, first)
        record.first_token_at = time.monotonic()
        record.stream = True
        self._describe_while_up(body["model"])
        relay = self._relay(first, chunks, ticket, client_wants_usage, record, reservation, op.name == "chat",
                            STREAM_SHAPES[op.streams_as])
        # A client that hangs up before the first byte is sent never starts the
        # relay, so its `finally` never runs: settle when the unstarted relay is dropped
        # (otherwise its lease would be renewed for as long as the ingress lives).
        weakref.finalize(relay, self._dropped_unstarted, ticket, chunks, record)
        return Reply(ticket.headers, stream=relay)

    def _start_early(self, handle, op: Operation, body: dict, key: KeyRecord, model: str,
                     reservation: Reservation) -> "_EarlyStart | None":
        """Send a stream to ``model``'s replicas before its admission, if its key may
        (``Access.may_start_before_admission``), the fair-share gate has a place at
        once and the model is busy or ``start_early_when_idle``; else None, and the
        request takes the ordinary path.

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
        request_id = new_request_id(key.id)
        if op.carries_request_id:
            body["request_id"] = request_id
        _ask_for_usage(op, body)
        chunks = handle.options(stream=True).stream.remote(op.replica_operation, body)
        # Pulling the first item is what starts an in-process replica's engine
        # request (a handle's call is already on its way to a replica).
        return _EarlyStart(request_id, chunks, asyncio.ensure_future(chunks.__anext__()), place)

    def _queue_full(self, model: str, limit: int) -> bool:
        """Whether ``model``'s queue holds ``limit`` waiting requests (a negative limit: unbounded)."""
        return 0 <= limit <= self._waiting[model]

    async def _hand_on(self, model: str, ticket: Ticket, send, timeout_s: float, rank: int, place=None):
        """``send()`` the request to ``model``'s replicas once the fair-share gate gives
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
            place = await gate.enter(ticket.key.id, rank)
            ticket.on_settle = place.leave

        self._waiting[model] += 1
        try:
            return await reach_replica(send, timeout_s, take_a_place if gate is not None else None)
        finally:
            self._waiting[model] -= 1

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

    async def _relay(
        self,
        start: StreamStart,
        chunks,
        ticket: Ticket,
        client_wants_usage: bool,
        record: RequestRecord,
        reservation: Reservation,
        chat: bool,
        shape: StreamShape,
    ):
        """Relay the replica's stream and account for it.

        The usage event (always requested from the replica) is read from the
        final item and hidden unless the client asked for it. If the client goes
        away, cancel downstream (Serve cancels the replica's generator, vLLM aborts).
        A stream that fails (its replica or engine died: an exception here, or
        vLLM's own error event) is charged what it delivered, never its whole
        reservation: the prompt estimate plus one token per content event relayed
        (an event carries at least one token, up to ``stream_batch_tokens`` beside
        other streams, so this errs in the client's favour; chat's first event per
        choice is the role alone)."""
        status, usage, drained = "cancelled", None, False
        replica, first = start.replica, start.text
        events, last = 0, first
        try:
            first, usage = shape.usage(first, client_wants_usage)
            events, last = first.count("data: {"), first
            yield first
            if usage is not None:
                status = "completed"
            self.access.running(ticket, replica)
            async for chunk in chunks:
                if ticket.revoked:  # its key revoked while it runs (Access.stop_revoked): ends below, as failed
                    raise KeyRevoked
                if usage is None:
                    chunk, usage = shape.usage(chunk, client_wants_usage)
                events += chunk.count("data: {")
                last = chunk
                yield chunk
                if usage is not None:
                    # The client has the whole stream, usage trailer and [DONE]: it may
                    # hang up now (the openai SDK closes at [DONE]) while the replica's
                    # stream is still ending; that is a complete stream, charged its usage.
                    status = "completed"
            drained = True
            # vLLM ends a stream whose engine failed with an error event and no usage.
            failed_upstream = usage is None and shape.failed(last)
            events -= failed_upstream
            status = "failed" if failed_upstream else "completed"
        except Exception:
            if usage is not None:  # failed after the final usage event: the client has it all
                status = "completed"
            elif ticket.revoked:
                status = "failed"
                yield KEY_REVOKED
            else:
                status = "failed"
                logger.exception("stream from replica failed")
                yield STREAM_FAILED
        finally:
            if not drained:
                chunks.cancel()
            if status == "failed":
                usage = _delivered(events, reservation, chat)
            # The key's fair-share counter first, before its place goes to the next one;
            # a cancelled stream's usage is unknown: the counter takes what was relayed.
            self._served(record.model, ticket.key.id, usage or _delivered(events, reservation, chat))
            # And its reservation stays charged.
            self.access.settle(ticket, status, None if status == "cancelled" else usage, replica)
            record.status, record.cancelled = 200, status == "cancelled"
            if status == "failed":
                record.error_code = "stream_failed"
            record.used(usage)
            self.telemetry.finish(record)


def _ask_for_usage(op: Operation, body: dict) -> None:
    """Usage is always asked for: it settles the token reservation. (Anthropic's
    streams always carry it.)"""
    if op.streams_as == "openai":
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}


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


def _delivered(events: int, reservation: Reservation, chat: bool) -> Usage:
    """What a failed stream is charged: its prompt (estimated) and one token per
    content event it relayed, never more than it reserved."""
    content_events = events - (reservation.choices if chat else 0)
    completion = min(max(0, content_events), reservation.completion_per_choice * reservation.choices)
    return Usage(reservation.prompt, completion)
