"""``Gateway.run`` for a unary request, with the replica side faked: every way
a call can end becomes the right answer (a 503 with retry-after, never a 500
for what is not a bug) and the request is settled exactly once, as what it was.
(The streamed side: test_stream_settlement.py; the real path: the e2e suite.)"""

import asyncio
import json
from types import SimpleNamespace

import pytest
from cache_secret import salts
from ray.exceptions import ActorUnavailableError
from ray.serve.exceptions import BackPressureError

from contract.model_config import ModelConfig
from contract.replica_wire import ReplicaAnswer, ReplicaError, Usage
from serve_app.admission.seam import Ticket
from serve_app.errors import OpenAIError
from serve_app.identity.keys import KeyRecord
from serve_app.pipeline.gateway import Gateway
from serve_app.telemetry import RequestRecord, Telemetry

KEY = KeyRecord(id="k1", name="n", created_at=0)
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
USAGE = Usage(prompt_tokens=3, completion_tokens=4)


class Access:
    """Admits everything; records each settlement."""

    default_max_tokens = 16

    def __init__(self):
        self.settled, self.admitted = [], []

    async def team_of(self, key, model):
        return None

    def authorize(self, key, model):
        if not key.allows_model(model):
            raise OpenAIError(403, "no", param="model")

    def overloaded(self):
        return False

    async def admit(
        self, key, model, tokens, http_request_id, request_id=None, reserve_nanos=0, request_paid=False, given_id=None
    ):
        ticket = Ticket(key, request_id or given_id or "req-1", model, headers={"x-ratelimit-limit-requests": "10"})
        self.admitted.append(ticket)
        return ticket

    def settle(self, ticket, status, usage=None, replica=""):
        assert not ticket.settled, "settled twice"
        ticket.settled = True
        if ticket.on_settle is not None:  # as serve_app.admission.gatekeeper.Gatekeeper does
            ticket.on_settle()
        self.settled.append((status, usage))

    async def withdraw(self, ticket, keep_request=False):
        self.settle(ticket, "withdrawn")  # its admission taken back: nothing of it counts


class Response:
    """A unary call: ``assign`` is how reaching a replica ends, ``result`` how the call does."""

    def __init__(self, assign=None, result=None):
        self.assign, self.result, self.cancelled = assign, result, False

    async def _fetch_future_result_async(self):
        if self.assign == "never":
            await asyncio.sleep(3600)
        if isinstance(self.assign, BaseException):
            raise self.assign

    async def __aiter__(self):  # the gateway sends a unary call as a stream of its one answer
        if isinstance(self.result, BaseException):
            raise self.result
        yield self.result

    def cancel(self):
        self.cancelled = True


class Handle:
    """What the gateway uses of a ``DeploymentHandle`` for a unary call:
    ``options(stream=True).call_streamed.remote(operation, body)``."""

    def __init__(self, remote):
        self.call_streamed = SimpleNamespace(remote=remote)

    def options(self, **_):
        return self


def run(response):
    """(the fake access, the coroutine of one chat request answered by ``response``)."""
    access = Access()
    handle = Handle(lambda *_, **__: response)
    gateway = Gateway(
        access,
        {"tiny-llama": handle},
        [ModelConfig(name="tiny-llama", queue_timeout_s=0.2)],
        Telemetry(False, False),
        salts(),
    )

    async def go():
        return await gateway.run(KEY, "chat", dict(CHAT), 100, RequestRecord("openai", "x"))

    return access, go()


async def outcome(response):
    access, call = run(response)
    try:
        return access, await call
    except OpenAIError as exc:
        return access, exc


async def test_an_answer_is_settled_completed_with_its_usage():
    access, reply = await outcome(Response(result=ReplicaAnswer(b'{"ok": 1}', USAGE, "r1")))
    assert reply.body == b'{"ok": 1}' and reply.headers["x-ratelimit-limit-requests"] == "10"
    assert access.settled == [("completed", USAGE)]


@pytest.mark.parametrize(
    "response, code, settled",
    [
        (Response(assign="never"), "model_unavailable", "overloaded"),  # no replica took it in the queue timeout
        (
            Response(assign=BackPressureError(num_queued_requests=9, max_queued_requests=8)),
            "model_overloaded",
            "overloaded",
        ),
        (
            Response(result=ActorUnavailableError("gone", None)),
            "replica_unavailable",
            "failed",
        ),  # replica died mid-call
    ],
)
async def test_a_call_that_cannot_be_served_is_a_503_with_retry_after(response, code, settled):
    access, error = await outcome(response)
    assert isinstance(error, OpenAIError), error
    assert error.status == 503 and error.code == code
    assert error.headers["retry-after"] == "1" and error.headers["x-ratelimit-limit-requests"] == "10"
    assert access.settled == [(settled, Usage())]  # nothing ran: nothing charged
    if response.assign == "never":
        assert response.cancelled  # withdrawn from Serve's queue


async def test_a_replica_503_keeps_its_code_and_gets_retry_after():
    body = {"message": "The engine died.", "type": "ServiceUnavailable", "code": "replica_unavailable"}
    access, error = await outcome(Response(result=ReplicaError(503, body, "r1")))
    assert error.status == 503 and error.code == "replica_unavailable" and error.headers["retry-after"] == "1"
    assert access.settled == [("failed", Usage())]


async def test_an_engine_400_is_a_400_without_retry_after_and_settled_failed():
    body = {
        "message": "This model's maximum context length is 2048 tokens.",
        "type": "BadRequestError",
        "param": "messages",
        "code": 400,
    }
    access, error = await outcome(Response(result=ReplicaError(400, body, "r1")))
    assert error.status == 400 and error.param == "messages" and "retry-after" not in error.headers
    assert access.settled == [("failed", Usage())]  # refused before generating


async def test_a_call_that_fails_on_its_way_is_a_502_charged_nothing():
    # What Serve's gRPC raised for a message over its limit: nothing reached the client.
    access, error = await outcome(Response(result=RuntimeError("Received message larger than max")))
    assert isinstance(error, OpenAIError) and error.status == 502 and error.code == "replica_call_failed"
    assert error.headers["retry-after"] == "1" and error.headers["x-ratelimit-limit-requests"] == "10"
    assert access.settled == [("failed", Usage())]


async def test_a_stream_whose_first_item_fails_on_its_way_is_a_502_charged_nothing():
    access = Access()

    async def failing_chunks():
        raise RuntimeError("Received message larger than max")
        yield  # a generator

    class Streamed(Response):
        def __aiter__(self):
            return self

        def __anext__(self):
            return failing_chunks().__anext__()

    stream_handle = SimpleNamespace(remote=lambda *_, **__: Streamed())
    handle = SimpleNamespace(options=lambda **_: SimpleNamespace(stream=stream_handle))
    gateway = Gateway(
        access,
        {"tiny-llama": handle},
        [ModelConfig(name="tiny-llama", queue_timeout_s=0.2)],
        Telemetry(False, False),
        salts(),
    )
    with pytest.raises(OpenAIError) as caught:
        await gateway.run(KEY, "chat", {**CHAT, "stream": True}, 100, RequestRecord("openai", "x"))
    assert caught.value.status == 502 and access.settled == [("failed", Usage())]


async def test_a_client_gone_mid_call_keeps_its_reservation_charged():
    access, call = run(Response(result=asyncio.CancelledError()))
    with pytest.raises(asyncio.CancelledError):
        await call
    assert access.settled == [("failed", None)]  # the engine may have generated: the reservation holds


async def test_refusals_before_admission_settle_nothing():
    for body in ({**CHAT, "model": "nope"}, {**CHAT, "max_tokens": "4"}, {**CHAT, "messages": []}):
        access = Access()
        gateway = Gateway(
            access, {"tiny-llama": None}, [ModelConfig(name="tiny-llama")], Telemetry(False, False), salts()
        )
        with pytest.raises(OpenAIError) as caught:
            await gateway.run(KEY, "chat", json.loads(json.dumps(body)), 100, RequestRecord("openai", "x"))
        assert caught.value.status in (400, 404) and access.settled == []


# -- priority tiers ------------------------------------------------------------------


def tiered_gateway(engine_kwargs=None, max_queued=4):
    """A gateway whose calls wait for a replica until released; returns (gateway,
    access, bodies the replica was sent, release)."""
    access, sent, release = Access(), [], asyncio.Event()

    class Waiting(Response):
        async def _fetch_future_result_async(self):
            await release.wait()

    def remote(operation, body, trace=None, prompt_allowance=None):
        sent.append(body)
        return Waiting(result=ReplicaAnswer(b"{}", USAGE, "r1"))

    handle = Handle(remote)
    config = ModelConfig(
        name="tiny-llama", engine_kwargs=engine_kwargs or {}, deployment={"max_queued_requests": max_queued}
    )
    return Gateway(access, {"tiny-llama": handle}, [config], Telemetry(False, False), salts()), access, sent, release


def tier(name: str) -> KeyRecord:
    return KeyRecord(id=f"k-{name}", name=name, created_at=0, priority=name)


async def answer_or_error(gateway: Gateway, key: KeyRecord):
    """One chat request through ``gateway``: its reply, or the OpenAIError it raised."""
    try:
        return await gateway.run(key, "chat", dict(CHAT), 100, RequestRecord("openai", "x"))
    except OpenAIError as exc:
        return exc


async def test_lower_tiers_are_refused_first_as_the_queue_fills():
    gateway, access, sent, release = tiered_gateway(max_queued=4)  # shares: low 2, normal 3, high 4
    calls = []

    for key in (tier("low"), tier("low")):  # two waiting: the low share is full
        calls.append(asyncio.create_task(answer_or_error(gateway, key)))
    await asyncio.sleep(0)
    low = await answer_or_error(gateway, tier("low"))
    assert isinstance(low, OpenAIError) and (low.status, low.code) == (503, "model_overloaded")
    assert "low-priority" in low.message and low.headers["retry-after"] == "1"
    calls.append(asyncio.create_task(answer_or_error(gateway, tier("normal"))))  # three waiting
    await asyncio.sleep(0)
    normal = await answer_or_error(gateway, tier("normal"))
    assert isinstance(normal, OpenAIError) and normal.code == "model_overloaded"
    calls.append(asyncio.create_task(answer_or_error(gateway, tier("high"))))  # the last place is a high key's
    await asyncio.sleep(0)
    high = await answer_or_error(gateway, tier("high"))
    assert isinstance(high, OpenAIError) and high.code == "model_overloaded"
    assert len(sent) == 4  # refused requests never reached Serve
    release.set()
    replies = await asyncio.gather(*calls)
    assert all(not isinstance(reply, OpenAIError) for reply in replies)
    assert sorted(status for status, _ in access.settled) == ["completed"] * 4 + ["overloaded"] * 3
    assert gateway._waiting["tiny-llama"] == 0  # nothing counted as waiting once answered
    # The queue drained: a low key is served again.
    assert not isinstance(await answer_or_error(gateway, tier("low")), OpenAIError)


async def test_requests_admitted_together_queue_no_more_than_the_bound():
    """A burst all passes the queue's first look while Redis admits it: the queue
    is looked at again after admission (the e2e backpressure test saw two queue per
    ingress replica where the bound was one)."""
    gateway, access, sent, release = tiered_gateway(max_queued=4)
    admit = access.admit

    async def slow_admit(*args, **kwargs):
        await asyncio.sleep(0.01)  # a Redis round trip: every request of the burst is in it together
        return await admit(*args, **kwargs)

    access.admit = slow_admit

    calls = [asyncio.create_task(answer_or_error(gateway, tier("high"))) for _ in range(10)]
    while len(sent) + len(access.settled) < 10:
        await asyncio.sleep(0.01)
    assert len(sent) == 4 and [status for status, _ in access.settled] == ["overloaded"] * 6
    release.set()
    replies = await asyncio.gather(*calls)
    assert sum(isinstance(reply, OpenAIError) and reply.code == "model_overloaded" for reply in replies) == 6
    assert gateway._waiting["tiny-llama"] == 0


async def test_the_key_tier_is_the_engine_priority_and_a_client_cannot_set_its_own():
    gateway, _, sent, release = tiered_gateway(engine_kwargs={"scheduling_policy": "priority"})
    release.set()
    for name, expected in (("high", 0), ("normal", 1), ("low", 2)):
        await gateway.run(tier(name), "chat", {**CHAT, "priority": -1000}, 100, RequestRecord("openai", "x"))
        assert sent[-1]["priority"] == expected
    plain, _, sent, release = tiered_gateway()  # FCFS engine: vLLM refuses any priority but 0
    release.set()
    await plain.run(tier("high"), "chat", {**CHAT, "priority": -1000}, 100, RequestRecord("openai", "x"))
    assert "priority" not in sent[-1]


# -- fair share: a place is freed however the request ends --------------------------


@pytest.mark.parametrize("first_ends", ["answered", "queue_timeout", "engine_error"])
async def test_the_next_request_gets_the_place_however_the_first_ends(monkeypatch, first_ends):
    from serve_app.routing import places

    monkeypatch.setitem(places._PLACES, "model-tiny-llama", 1)  # one place: one request in flight
    access, sent, release = Access(), [], asyncio.Event()
    first_result = (
        ReplicaError(500, {"message": "boom"}, "r1")
        if first_ends == "engine_error"
        else ReplicaAnswer(b"{}", USAGE, "r1")
    )

    class First(Response):
        async def _fetch_future_result_async(self):
            if first_ends == "queue_timeout":
                await asyncio.sleep(3600)
            await release.wait()

    def remote(operation, body, trace=None, prompt_allowance=None):
        sent.append(body)
        return First(result=first_result) if len(sent) == 1 else Response(result=ReplicaAnswer(b"{}", USAGE, "r1"))

    handle = Handle(remote)
    # Times wide enough for a loaded box (a CI neighbour stalled this loop past a 0.3 s bound).
    config = ModelConfig(name="tiny-llama", queue_timeout_s=1.5)
    gateway = Gateway(access, {"tiny-llama": handle}, [config], Telemetry(False, False), salts())

    first = asyncio.create_task(answer_or_error(gateway, tier("normal")))
    await asyncio.sleep(0.75)  # the second's queue timeout ends this much after the first's
    second = asyncio.create_task(answer_or_error(gateway, KeyRecord(id="k2", name="other", created_at=0)))
    await asyncio.sleep(0.1)
    assert len(sent) == 1 and gateway._waiting["tiny-llama"] == 2  # the second waits at the gate
    release.set()
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert len(sent) == 2 and not isinstance(second.result(), OpenAIError)
    gate = gateway._gates["tiny-llama"]
    assert gate.in_flight == 0 and gate.waiting == 0 and gateway._waiting["tiny-llama"] == 0


def recording_gateway(answer: ReplicaAnswer):
    """(a gateway whose replica answers ``answer``, its fake access, what each call sent)."""
    sent, access = [], Access()

    def remote(*args, **kwargs):
        sent.append(args)
        return Response(result=answer)

    gateway = Gateway(
        access, {"tiny-llama": Handle(remote)}, [ModelConfig(name="tiny-llama")], Telemetry(False, False), salts()
    )
    return gateway, access, sent


@pytest.mark.parametrize(
    "operation, body",
    [
        ("tokenize", {"model": "tiny-llama", "prompt": "hi"}),
        ("detokenize", {"model": "tiny-llama", "tokens": [1, 2]}),
    ],
)
async def test_the_tokenizer_endpoints_reach_the_replica_as_sent_and_are_charged_nothing(operation, body):
    gateway, access, sent = recording_gateway(ReplicaAnswer(b'{"tokens": [1]}', None, "r1"))
    reply = await gateway.run(KEY, operation, dict(body), 100, RequestRecord("vllm", "x"))
    # No request id nor priority: vLLM's tokenizer request models know neither.
    assert sent == [(operation, body)] and reply.body == b'{"tokens": [1]}'
    assert access.settled == [("completed", Usage())]


async def test_templated_completions_are_admitted_as_completions_and_run_as_the_replica_names_them():
    from serve_app.wire.api_requests import TEMPLATED_COMPLETIONS

    gateway, _, sent = recording_gateway(ReplicaAnswer(b"{}", USAGE, "r1"))
    record = RequestRecord("databricks", "x")
    await gateway.run(KEY, TEMPLATED_COMPLETIONS, {"model": "tiny-llama", "prompt": ["a", "b"]}, 100, record)
    [(operation, body)] = sent
    assert operation == "templated_completions" and record.operation == "completions"
    assert body["max_tokens"] == 16 and body["request_id"] == "req-1"  # completions' default, set explicitly


async def test_a_unary_call_of_a_key_revoked_while_it_runs_is_cancelled_and_charged_its_prompt():
    from ray.serve.exceptions import RequestCancelledError

    class Running(Response):
        """Runs until cancelled; then reading it raises as Serve's does."""

        def __init__(self):
            super().__init__()
            self.stop = asyncio.Event()

        async def __aiter__(self):
            await self.stop.wait()
            raise RequestCancelledError("req-1")
            yield

        def cancel(self):
            self.cancelled = True
            self.stop.set()

    response = Running()
    access, call = run(response)
    task = asyncio.create_task(call)
    await asyncio.sleep(0.05)
    [ticket] = access.admitted
    assert not task.done() and ticket.on_revoke is not None
    ticket.revoked = True  # what Access.stop_revoked does once the key is gone
    ticket.on_revoke()
    with pytest.raises(OpenAIError) as refused:
        await asyncio.wait_for(task, 1)
    assert refused.value.status == 401 and refused.value.code == "invalid_api_key" and response.cancelled
    [(status, usage)] = access.settled
    # The prompt as reserved (its 100 bytes of body at 4 per token), nothing of the 4 max tokens.
    assert status == "failed" and usage == Usage(prompt_tokens=25, completion_tokens=0)


async def test_what_completes_a_body_once_admitted_runs_after_admission_and_its_refusal_charges_nothing():
    calls = []
    access = Access()
    handle = Handle(
        lambda operation, body, **_: calls.append(body) or Response(result=ReplicaAnswer(b"{}", USAGE, "r1"))
    )
    gateway = Gateway(
        access,
        {"tiny-llama": handle},
        [ModelConfig(name="tiny-llama", queue_timeout_s=0.2)],
        Telemetry(False, False),
        salts(),
    )

    async def history_gone():
        assert access.admitted and not calls  # admitted, nothing sent yet
        raise OpenAIError(404, "No response found.", code="response_not_found")

    with pytest.raises(OpenAIError) as caught:
        await gateway.run(KEY, "chat", dict(CHAT), 100, RequestRecord("openai", "x"), once_admitted=history_gone)
    assert caught.value.status == 404 and caught.value.headers["x-ratelimit-limit-requests"] == "10"
    assert access.settled == [("failed", Usage())] and calls == []

    body = dict(CHAT)

    async def complete():
        body["messages"] = [{"role": "user", "content": "earlier"}, *body["messages"]]

    await gateway.run(KEY, "chat", body, 100, RequestRecord("openai", "y"), once_admitted=complete)
    assert [m["content"] for m in calls[0]["messages"]] == ["earlier", "hi"]  # sent as completed


# -- the prompt's reservation, enforced by the replica ---------------------------------


class CountingReplica:
    """A replica whose prompt renders to ``prompt_tokens``: a call whose allowance is
    smaller is refused as the real replica refuses it (nothing ran)."""

    def __init__(self, prompt_tokens: int, counts: list[int] | None = None):
        self.counts = counts or [prompt_tokens]  # what each rendering comes to
        self.allowances = []

    def remote(self, operation, body, trace=None, prompt_allowance=None):
        self.allowances.append(prompt_allowance)
        used = self.counts[min(len(self.allowances), len(self.counts)) - 1]
        if prompt_allowance is not None and used > prompt_allowance:
            return Response(
                result=ReplicaError(
                    409, {"message": "over", "code": "prompt_over_allowance", "prompt_tokens": used}, "r1"
                )
            )
        return Response(result=ReplicaAnswer(b"{}", Usage(prompt_tokens=used, completion_tokens=4), "r1"))


class SizingAccess(Access):
    """Records the tokens each admission reserved, whether its request was already
    paid (``request_paid``), and whether each withdrawal kept its request."""

    def __init__(self):
        super().__init__()
        self.reserved, self.paid, self.kept = [], [], []

    async def admit(
        self, key, model, tokens, http_request_id, request_id=None, reserve_nanos=0, request_paid=False, given_id=None
    ):
        self.reserved.append(tokens)
        self.paid.append(request_paid)
        return await super().admit(key, model, tokens, http_request_id, request_id, reserve_nanos, request_paid)

    async def withdraw(self, ticket, keep_request=False):
        self.kept.append(keep_request)
        await super().withdraw(ticket, keep_request)


def sizing_gateway(replica: CountingReplica):
    access = SizingAccess()
    gateway = Gateway(
        access,
        {"tiny-llama": Handle(replica.remote)},
        [ModelConfig(name="tiny-llama")],
        Telemetry(False, False),
        salts(),
    )
    return gateway, access


async def test_a_prompt_over_its_estimate_is_admitted_again_at_its_real_size():
    replica = CountingReplica(prompt_tokens=900)  # 100 bytes estimated as 25 tokens
    gateway, access = sizing_gateway(replica)
    reply = await gateway.run(KEY, "chat", dict(CHAT), 100, RequestRecord("openai", "x"))
    assert reply.body == b"{}"
    assert replica.allowances == [25, 900]  # the engine never took more than was reserved
    assert access.reserved == [25 + 4, 900 + 4]
    # A render is a request: the withdrawal keeps its request of requests/min, and the
    # second admission does not charge one again.
    assert access.kept == [True] and access.paid == [False, True]
    # The refused attempt was withdrawn (its reservation and record); the second is
    # charged its real usage, within its reservation.
    assert access.settled == [("withdrawn", None), ("completed", Usage(prompt_tokens=900, completion_tokens=4))]


async def test_a_prompt_within_its_estimate_is_sent_once():
    replica = CountingReplica(prompt_tokens=20)
    gateway, access = sizing_gateway(replica)
    await gateway.run(KEY, "chat", dict(CHAT), 100, RequestRecord("openai", "x"))
    assert replica.allowances == [25] and access.reserved == [29]


async def test_a_prompt_whose_count_changes_again_is_a_503_never_an_overrun():
    replica = CountingReplica(prompt_tokens=0, counts=[900, 1800])
    gateway, access = sizing_gateway(replica)
    with pytest.raises(OpenAIError) as caught:
        await gateway.run(KEY, "chat", dict(CHAT), 100, RequestRecord("openai", "x"))
    assert caught.value.status == 503 and caught.value.code == "prompt_resize_failed"
    assert access.settled == [("withdrawn", None), ("withdrawn", None)]


async def test_the_tokenizer_routes_send_no_allowance():
    replica = CountingReplica(prompt_tokens=10**6)
    gateway, access = sizing_gateway(replica)
    await gateway.run(KEY, "tokenize", {"model": "tiny-llama", "prompt": "hi"}, 100, RequestRecord("openai", "x"))
    assert replica.allowances == [None]
