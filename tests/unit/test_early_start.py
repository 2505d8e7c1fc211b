"""A stream started before its admission (``Gateway._start_early``, a direct
route's gateway), the replica and Redis faked: on a busy model it reaches the replica before Redis answers,
under the id Redis admits; nothing is relayed before the admission; a refusal
or a client gone while Redis decides ends the call and frees its fair-share
place; for a key without room, or with no free place, the request waits for
its admission first; on an idle model it starts early only with
``start_early_when_idle`` (the default setting), and without it, in a burst on
an idle model only the first request waits. (The real path, engine and Redis:
tests/e2e/direct_route_stack/test_2_direct_route_e2e.py.)"""

import asyncio
from types import SimpleNamespace

import pytest
from cache_secret import salts

from contract.model_config import ModelConfig
from contract.replica_wire import ReplicaError, StreamStart
from serve_app.accounting.usage import edge_request_tag
from serve_app.admission.seam import Refusal, Ticket
from serve_app.errors import OpenAIError
from serve_app.identity.keys import KeyRecord
from serve_app.pipeline.gateway import Gateway
from serve_app.routing import places
from serve_app.telemetry import RequestRecord, Telemetry

KEY = KeyRecord(id="k1", name="n", created_at=0)
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
USAGE = 'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}\n\n'


class Access:
    """Redis' answer is a future the test resolves; records what happened when."""

    default_max_tokens = 16

    def __init__(self, may_start_early=True, overloaded=False):
        self.may_start_early, self._overloaded = may_start_early, overloaded
        self.decision = asyncio.get_running_loop().create_future()
        self.events, self.settled, self.asked = [], [], []

    async def team_of(self, key, model):
        return None

    def authorize(self, key, model):
        pass

    def overloaded(self):
        return self._overloaded

    def may_start_before_admission(self, key, tokens):
        return self.may_start_early

    async def admit(
        self, key, model, tokens, http_request_id, request_id=None, reserve_nanos=0, request_paid=False, given_id=None
    ):
        self.events.append("admission asked")
        self.asked.append((request_id, given_id))
        refused = await self.decision  # a limit's kind, or None
        if refused is not None:
            return Refusal(key, refused, tokens, retry_s=1.0)
        self.events.append("admitted")
        return Ticket(key, request_id or "k1-late", model, headers={"x-ratelimit-limit-requests": "10"})

    def settle(self, ticket, status, usage=None, replica=""):
        if not ticket.settled:
            ticket.settled = True
            if ticket.on_settle is not None:
                ticket.on_settle()
            self.settled.append(status)

    def running(self, ticket, replica=""):
        pass

    async def withdraw(self, ticket, keep_request=False):
        ticket.settled = True
        self.settled.append("withdrawn")


class Chunks:
    """The replica's stream; records when the engine was asked and whether the call was
    cancelled. ``over``: the prompt renders past its allowance, refused as the real replica
    refuses it (nothing ran)."""

    def __init__(self, access, body, over=False):
        self.access, self.body, self.over = access, body, over
        self.cancelled = False
        access.events.append("engine started")

    async def _fetch_future_result_async(self):
        return None

    async def __anext__(self):
        if self.over:
            return ReplicaError(409, {"message": "over", "code": "prompt_over_allowance", "prompt_tokens": 900}, "r1")
        return StreamStart("r1", 'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n')

    def __aiter__(self):
        return self._rest()

    async def _rest(self):
        yield USAGE + "data: [DONE]\n\n"

    def cancel(self):
        self.cancelled = True


def gateway(access, fair_share=False, busy=True, when_idle=False, dense=False):
    """A gateway in front of the faked replica; ``busy``: another request of the model
    is in flight; ``when_idle``: streams start early on an idle model too; ``dense``:
    the prompt renders to 900 tokens, past any allowance under that."""
    sent = []

    def remote(operation, body, trace=None, prompt_allowance=None):
        sent.append(Chunks(access, body, over=dense and prompt_allowance < 900))
        return sent[-1]

    handle = SimpleNamespace(options=lambda **_: SimpleNamespace(stream=SimpleNamespace(remote=remote)))
    config = ModelConfig(name="tiny-llama", fair_share={"enabled": fair_share})
    telemetry = Telemetry(False, False)
    if busy:
        telemetry.admitted(RequestRecord("openai", "other", model="tiny-llama"))
    return Gateway(
        access, {"tiny-llama": handle}, [config], telemetry, salts(), start_early=True, start_early_when_idle=when_idle
    ), sent


async def start(gw):
    return asyncio.ensure_future(gw.run(KEY, "chat", dict(CHAT), 100, RequestRecord("openai", "x")))


async def admitted_before_the_engine_starts(gw, access, sent):
    """Run a stream that must wait for its admission: nothing reaches the replica
    before Redis answers, the engine starts after it. Its reply."""
    run = await start(gw)
    await asyncio.sleep(0.05)
    assert access.events == ["admission asked"] and not sent
    access.decision.set_result(None)
    reply = await run
    assert access.events == ["admission asked", "admitted", "engine started"]
    return reply


async def test_a_stream_reaches_the_replica_before_redis_answers_and_under_the_id_redis_admits():
    access = Access()
    gw, sent = gateway(access)
    run = await start(gw)
    await asyncio.sleep(0.05)
    assert access.events == ["engine started", "admission asked"] and not run.done()  # nothing relayed yet
    access.decision.set_result(None)
    reply = await run
    assert reply.headers["x-ratelimit-limit-requests"] == "10"
    relayed = "".join([item async for item in reply.stream])
    assert relayed.endswith("data: [DONE]\n\n") and '"usage"' not in relayed  # usage asked for, not shown
    body = sent[0].body
    assert body["request_id"].startswith("k1-") and body["stream_options"] == {"include_usage": True}
    assert access.settled == ["completed"] and not sent[0].cancelled


async def test_a_stream_the_edge_named_starts_under_the_edges_id_and_is_admitted_as_the_edges():
    """So an early start of the edge's try again takes over its first's admission, and
    one whose first was already settled is admitted anew (the gatekeeper tells them
    apart by ``given_id``: tests/integration/test_quota_hardening.py)."""
    access = Access()
    gw, sent = gateway(access)
    tag = edge_request_tag("0b9f4a52-5c1e-4f7e-9d6a-2f0e3c4b5a69", "1764000000000000")
    run = asyncio.ensure_future(gw.run(KEY, "chat", dict(CHAT), 100, RequestRecord("openai", "x", edge_tag=tag)))
    await asyncio.sleep(0.05)
    access.decision.set_result(None)
    await run
    assert sent[0].body["request_id"] == f"k1-{tag}" and access.asked == [(f"k1-{tag}", f"k1-{tag}")]


@pytest.mark.parametrize("ending", ["refused", "client gone"])
async def test_a_refusal_or_a_client_gone_during_admission_ends_the_call_and_frees_its_place(ending, monkeypatch):
    monkeypatch.setitem(
        places._PLACES, "model-tiny-llama", 1
    )  # one place in all: a leaked one would block the next request
    access = Access()
    gw, sent = gateway(access, fair_share=True)
    run = await start(gw)
    await asyncio.sleep(0.05)
    assert access.events == ["engine started", "admission asked"]
    gate = gw._gates["tiny-llama"]
    assert gate.in_flight == 1
    if ending == "refused":
        access.decision.set_result("requests")
        with pytest.raises(OpenAIError) as refused:
            await run
        assert refused.value.status == 429
    else:
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    await asyncio.sleep(0)
    assert sent[0].cancelled  # the replica's generator is cancelled: vLLM aborts the engine request
    assert gate.in_flight == 0 and access.settled == []  # never admitted: nothing to settle
    assert gw._admitting == {"tiny-llama": 0}  # the next request on an idle model is not taken for a burst


@pytest.mark.parametrize("idle_model, key_has_room", [(False, False), (True, True)])
async def test_a_key_without_room_or_an_idle_model_waits_for_its_admission_before_the_engine_starts(
    idle_model, key_has_room
):
    access = Access(may_start_early=key_has_room)
    gw, sent = gateway(access, busy=not idle_model)
    reply = await admitted_before_the_engine_starts(gw, access, sent)
    assert sent[0].body["request_id"] == "k1-late"
    assert "".join([item async for item in reply.stream]).endswith("data: [DONE]\n\n")


async def test_on_an_idle_model_a_stream_starts_beside_its_admission_when_the_setting_says_so():
    access = Access()
    gw, sent = gateway(access, busy=False, when_idle=True)
    run = await start(gw)
    await asyncio.sleep(0.05)
    assert access.events == ["engine started", "admission asked"] and not run.done()  # nothing relayed yet
    access.decision.set_result(None)
    reply = await run
    assert sent[0].body["request_id"].startswith("k1-") and sent[0].body["request_id"] != "k1-late"  # admitted under it
    assert "".join([item async for item in reply.stream]).endswith("data: [DONE]\n\n")
    assert access.settled == ["completed"] and gw._admitting == {"tiny-llama": 0}


async def test_a_key_without_room_waits_for_its_admission_on_an_idle_model_too():
    access = Access(may_start_early=False)
    gw, sent = gateway(access, busy=False, when_idle=True)
    await admitted_before_the_engine_starts(gw, access, sent)


async def test_in_a_burst_on_an_idle_model_only_the_first_request_waits_for_its_admission():
    access = Access()
    gw, sent = gateway(access, busy=False)
    first = await start(gw)
    await asyncio.sleep(0.05)
    assert access.events == ["admission asked"] and not sent  # idle: admission first
    second = await start(gw)  # arrives while the first one's admission is in Redis
    await asyncio.sleep(0.05)
    assert access.events == ["admission asked", "engine started", "admission asked"]
    access.decision.set_result(None)
    for run in (first, second):
        reply = await run
        assert "".join([item async for item in reply.stream]).endswith("data: [DONE]\n\n")
    assert len(sent) == 2 and access.settled == ["completed", "completed"]
    assert gw._admitting == {"tiny-llama": 0}
    third = await start(gw)  # the burst is over: idle again, admission first
    await third
    assert access.events[-3:] == ["admission asked", "admitted", "engine started"]


async def test_a_model_with_no_free_place_waits_for_admission_first(monkeypatch):
    monkeypatch.setitem(places._PLACES, "model-tiny-llama", 1)
    access = Access()
    gw, sent = gateway(access, fair_share=True)
    taken = gw._gates["tiny-llama"].enter_now("another-key")  # the only place is busy
    run = await start(gw)
    await asyncio.sleep(0.05)
    assert access.events == ["admission asked"] and not sent  # not sent ahead of its fair turn
    access.decision.set_result(None)
    await asyncio.sleep(0.05)
    assert not sent  # admitted, waiting for the place
    taken.leave()
    reply = await run
    assert sent and "".join([item async for item in reply.stream]).endswith("data: [DONE]\n\n")


async def test_the_ingress_gateway_never_starts_a_stream_before_its_admission():
    access = Access()
    gw, sent = gateway(access)
    gw.start_early = False  # as the ingress builds it
    await admitted_before_the_engine_starts(gw, access, sent)


async def test_a_replica_whose_loop_is_far_behind_refuses_new_requests_before_anything_runs():
    """Shedding (quota.shed_loop_lag_s): a 503 with retry-after, no admission asked of
    Redis, nothing started in the engine, nothing to settle."""
    access = Access(overloaded=True)
    gw, sent = gateway(access)
    with pytest.raises(OpenAIError) as caught:
        await (await start(gw))
    assert (caught.value.status, caught.value.code) == (503, "gateway_overloaded")
    assert caught.value.headers["retry-after"] == "1"
    assert access.events == [] and not sent and access.settled == []


async def test_a_prompt_over_its_estimate_started_early_waits_for_its_admission_at_its_real_size():
    """Started early at its estimate, refused by the replica for its real size: admitted
    again, it reaches the engine only once Redis admits it (a request starts early once)."""
    access = Access()
    gw, sent = gateway(access, dense=True)
    access.decision.set_result(None)
    reply = await gw.run(KEY, "chat", dict(CHAT), 100, RequestRecord("openai", "x"))
    assert "".join([item async for item in reply.stream]).endswith("data: [DONE]\n\n")
    assert access.events == ["engine started", "admission asked", "admitted"] + [
        "admission asked",
        "admitted",
        "engine started",
    ]
    assert access.settled == ["withdrawn", "completed"]
    assert gw.telemetry.early_counts == {"admitted": 1, "withdrawn": 0}
