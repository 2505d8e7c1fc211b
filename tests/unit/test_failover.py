"""Failover, with the replicas faked: a request a replica fails before its first byte
is sent again elsewhere under its one admission (settled once, as what its last try
did); a 4xx, a stream that started and a request that used its tries are not; a
stalled stream is cut at ``first_token_timeout_s``; a model that cannot serve hands
the request to its fallback, at the fallback's price, unless the key may not use it.
The outlier policy (serve_app/routing/outliers.py) and the routers' filter over it.
(On the real stack: tests/e2e/test_failover_e2e.py, a replica killed and an engine
stalled; tests/e2e/test_autoscale_e2e.py, the fallback; the edge's try again:
tests/integration/test_haproxy_guard.py, test_admission.py and test_quota_hardening.py.)"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from cache_secret import salts
from ray.exceptions import ActorDiedError
from test_gateway_run import CHAT, KEY, USAGE, Access, Response
from test_routing import FakeReplica, ids, pending, queue, router_with

from contract.model_config import ModelConfig
from contract.replica_wire import AVOID, ReplicaAnswer, ReplicaError, StreamStart, Usage, as_replica_stream
from serve_app.accounting.usage import edge_attempt_tag, edge_request_tag, id_time
from serve_app.admission.seam import EdgeAdmissionSettled
from serve_app.errors import OpenAIError
from serve_app.identity.keys import KeyRecord
from serve_app.pipeline.gateway import EDGE_ADMISSIONS, FALLBACK_FROM_HEADER, Gateway
from serve_app.routing import outliers
from serve_app.routing.outliers import OutlierEjector
from serve_app.telemetry import RequestRecord, Telemetry

DEAD = ActorDiedError()
ENGINE_DIED = ReplicaError(503, {"message": "The engine died.", "code": "replica_unavailable"}, "r1")


class Replicas:
    """A model's handle whose calls are answered in turn by ``answers`` (a unary call:
    a ``Response``'s result; an exception raised); records each call's ``avoid``."""

    def __init__(self, *answers):
        self.answers, self.avoided = list(answers), []
        self.call_streamed = SimpleNamespace(remote=self._remote)

    def options(self, **_):
        return self

    def _remote(self, operation, body, **kwargs):
        self.avoided.append(kwargs.get(AVOID, ()))
        return Response(result=self.answers.pop(0))


def gateway(handles: dict, configs: list[ModelConfig], access=None):
    access = access or Access()
    telemetry = Telemetry(False, False)
    return access, telemetry, Gateway(access, handles, configs, telemetry, salts())


async def chat(gw, key=KEY, body=CHAT, stream=False):
    body = {**body, "stream": True} if stream else dict(body)
    return await gw.run(key, "chat", body, 100, RequestRecord("openai", "x"))


ANSWER = ReplicaAnswer(b'{"ok": 1}', USAGE, "r2")


@pytest.mark.parametrize("failure", [DEAD, ENGINE_DIED, ReplicaError(500, {"message": "boom"}, "r1")])
async def test_a_replica_failing_before_the_first_byte_is_retried_and_charged_once(failure):
    replicas = Replicas(failure, ANSWER)
    access, telemetry, gw = gateway({"tiny-llama": replicas}, [ModelConfig(name="tiny-llama")])
    reply = await chat(gw)
    assert reply.body == b'{"ok": 1}'
    assert len(access.admitted) == 1  # one admission
    assert access.settled == [("completed", USAGE)]  # one settlement, the answer's usage
    ticket = access.admitted[0]
    reason = "died" if failure is DEAD else "answered_5xx"
    assert ticket.failover == [f"{'unknown' if failure is DEAD else 'r1'}:{reason}"]
    # A replica that answered is left out of the try again; one that died, Serve drops.
    assert replicas.avoided == [(), () if failure is DEAD else ("r1",)]
    assert telemetry.failover_counts["retried"] == 1


async def test_a_client_error_is_never_retried():
    bad = ReplicaError(400, {"message": "too long", "param": "messages"}, "r1")
    replicas = Replicas(bad, ANSWER)
    access, _, gw = gateway({"tiny-llama": replicas}, [ModelConfig(name="tiny-llama")])
    with pytest.raises(OpenAIError) as error:
        await chat(gw)
    assert error.value.status == 400 and len(replicas.answers) == 1  # the second answer never asked for
    assert access.settled == [("failed", Usage())]


async def test_tries_are_bounded_and_the_last_failure_is_the_answer():
    replicas = Replicas(ENGINE_DIED, ENGINE_DIED, ENGINE_DIED, ANSWER)
    access, _, gw = gateway({"tiny-llama": replicas}, [ModelConfig(name="tiny-llama", failover={"retries": 2})])
    with pytest.raises(OpenAIError) as error:
        await chat(gw)
    assert error.value.status == 503 and error.value.headers["retry-after"] == "1"
    assert len(replicas.answers) == 1  # three tries, no fourth
    assert access.settled == [("failed", Usage())]


class Stream:
    """A streamed call: its first item after ``delay_s`` (or never), then ``rest``."""

    def __init__(self, first, delay_s: float = 0.0, rest=()):
        self.items, self.delay_s, self.cancelled = [first, *rest], delay_s, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
            self.delay_s = 0
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    async def _fetch_future_result_async(self):
        return None

    def cancel(self):
        self.cancelled = True


class Streams:
    def __init__(self, *streams):
        self.streams, self.avoided = list(streams), []
        self.stream = SimpleNamespace(remote=self._remote)

    def options(self, **_):
        return self

    def _remote(self, operation, body, **kwargs):
        self.avoided.append(kwargs.get(AVOID, ()))
        return self.streams.pop(0)


DONE = 'data: {"choices": []}\n\ndata: {"usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\ndata: [DONE]\n\n'


async def drain(reply):
    return "".join([chunk async for chunk in reply.stream])


async def test_a_stalled_stream_is_cut_at_its_first_token_timeout_and_sent_elsewhere():
    stalled = Stream(StreamStart("r1", DONE), delay_s=3600)
    streams = Streams(stalled, Stream(StreamStart("r2", DONE)))
    config = ModelConfig(name="tiny-llama", failover={"first_token_timeout_s": 0.1})
    access, telemetry, gw = gateway({"tiny-llama": streams}, [config])
    reply = await chat(gw, stream=True)
    assert "[DONE]" in await drain(reply)
    assert stalled.cancelled  # the stalled call ended: its engine aborts the request
    assert telemetry.failover_counts == {"retried": 1, "stalled": 1, "ejected": 0, "fell_back": 0}
    assert len(access.admitted) == 1 and [status for status, _ in access.settled] == ["completed"]


async def test_a_stream_that_started_is_not_retried():
    started = Stream(StreamStart("r1", 'data: {"choices": []}\n\n'), rest=[DEAD])
    streams = Streams(started, Stream(StreamStart("r2", DONE)))
    access, _, gw = gateway({"tiny-llama": streams}, [ModelConfig(name="tiny-llama")])
    reply = await chat(gw, stream=True)
    text = await drain(reply)
    assert '"error"' in text and len(streams.streams) == 1  # an error event; the second never called
    assert len(access.settled) == 1


async def test_a_try_again_gives_its_fair_share_place_back():
    # Two tries through the fair-share queue: the first one's place is left when it fails.
    replicas = Replicas(ENGINE_DIED, ANSWER)
    config = ModelConfig(name="tiny-llama", fair_share={"enabled": True})
    _, _, gw = gateway({"tiny-llama": replicas}, [config])
    await chat(gw)
    assert gw._gates["tiny-llama"].in_flight == 0


# -- fallbacks ----------------------------------------------------------------------


class Full:
    """A model's handle no replica of which is reached within its queue timeout."""

    def __init__(self):
        self.call_streamed = SimpleNamespace(remote=lambda *_, **__: Response(assign="never"))

    def options(self, **_):
        return self


def with_fallback(**key_fields):
    main = ModelConfig(name="big", queue_timeout_s=0.1, fallbacks=["small"])
    small = ModelConfig(name="small", pricing={"prompt_per_million": 1.0})
    answers = Replicas(ReplicaAnswer(b'{"model": "small"}', USAGE, "s1"))
    access, telemetry, gw = gateway({"big": Full(), "small": answers}, [main, small])
    return access, telemetry, gw, KeyRecord(id="k1", name="n", created_at=0, **key_fields)


async def test_a_model_that_cannot_serve_falls_back_at_the_fallbacks_price():
    access, telemetry, gw, key = with_fallback()
    reply = await chat(gw, key, {**CHAT, "model": "big"})
    assert reply.body == b'{"model": "small"}' and reply.headers[FALLBACK_FROM_HEADER] == "big"
    first, second = access.admitted
    assert first.model == "big" and second.model == "small"
    # The first admission withdrawn (it never ran), the fallback's charged: one charge.
    assert [status for status, _ in access.settled] == ["withdrawn", "completed"]
    assert second.failover == ["fallback_from:big"] and second.rates.prompt == 1000
    assert telemetry.failover_counts["fell_back"] == 1


async def test_a_stream_whose_first_event_is_the_engines_5xx_is_a_failure_before_its_first_byte():
    """vLLM ends a stream whose engine died before the first token with an error event
    as its only one: the replica hands that on as a ReplicaError (the gateway sends the
    request to another replica), not a stream started; a 4xx event stays the stream's."""
    dead = json.dumps(
        {
            "error": {
                "message": "EngineCore encountered an issue.",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
    )

    async def texts(*items):
        for item in items:
            yield item

    async def collected(*items):
        return [item async for item in as_replica_stream("r1", texts(*items))]

    [failed] = await collected(f"data: {dead}\n\ndata: [DONE]\n\n", "data: [DONE]\n\n")
    assert failed == ReplicaError(500, json.loads(dead)["error"], "r1")
    invalid = 'data: {"error": {"message": "bad", "type": "BadRequestError", "param": null, "code": 400}}\n\n'
    chunk = 'data: {"choices": []}\n\n'
    for first in (invalid, chunk, 'data: {"error": "not an object"}\n\n', 'data: {"error": {"code": "x"}}\n\n'):
        started, rest = await collected(first, "data: [DONE]\n\n")
        assert started == StreamStart("r1", first) and rest == "data: [DONE]\n\n"


async def test_each_admission_of_a_request_the_edge_named_takes_the_edges_next_id():
    """A request the edge named is admitted under ids made of the edge's, one per
    admission (here its first, then its fallback's after the first was withdrawn): the
    same sequence on each try the edge makes of it, so a try again takes over whichever
    of the first's admissions is open (admit.lua's 'again') and is charged once."""
    access, _, gw, key = with_fallback()
    tag = edge_request_tag("0b9f4a52-5c1e-4f7e-9d6a-2f0e3c4b5a69", "1764000000000000")
    await gw.run(key, "chat", {**CHAT, "model": "big"}, 100, RequestRecord("openai", "x", edge_tag=tag))
    first, second = access.admitted
    assert first.request_id == f"k1-{tag}" and second.request_id == f"k1-{edge_attempt_tag(tag, 1)}"
    assert id_time(second.request_id) == id_time(first.request_id) and first.request_id != second.request_id
    access, _, gw = gateway({"tiny-llama": Replicas(ANSWER)}, [ModelConfig(name="tiny-llama")])
    await chat_recorded(gw, key, RequestRecord("openai", "x", edge_tag=tag, edge_admissions=EDGE_ADMISSIONS))
    assert access.admitted[0].request_id == "req-1"  # past the bound: a new id


class Settled(Access):
    """Redis' answer to the edge's try again: the ids in ``settled_ids`` were held by its
    earlier try and reaped when it died (abandoned)."""

    def __init__(self, settled_ids):
        super().__init__()
        self.settled_ids, self.asked = set(settled_ids), []

    async def admit(self, key, model, tokens, http_request_id, request_id=None, given_id=None, **kwargs):
        self.asked.append(given_id)
        if given_id in self.settled_ids:
            raise EdgeAdmissionSettled(given_id)
        return await super().admit(key, model, tokens, http_request_id, request_id, given_id=given_id, **kwargs)


@pytest.mark.parametrize("settled", [1, 2])
async def test_a_try_again_whose_earlier_admission_was_reaped_takes_the_next_id(settled):
    """The first try died holding its admission and the reaper settled it before the try
    again came (no other replica was up to take it at once): the try goes down the edge's
    ids to the first that is not settled, admitted there as a new request and recorded
    so. (Two settled: the bound holds whatever Redis answers.)"""
    tag = edge_request_tag("0b9f4a52-5c1e-4f7e-9d6a-2f0e3c4b5a69", "1764000000000000")
    ids = [f"k1-{edge_attempt_tag(tag, n)}" for n in range(3)]
    access = Settled(ids[:settled])
    _, _, gw = gateway({"tiny-llama": Replicas(ANSWER)}, [ModelConfig(name="tiny-llama")], access)
    await chat_recorded(gw, KEY, RequestRecord("openai", "x", edge_tag=tag))
    assert access.asked == ids[: settled + 1]
    [ticket] = access.admitted
    assert ticket.request_id == ids[settled] and ticket.failover == ["edge:admitted_anew"]


async def chat_recorded(gw, key, record):
    return await gw.run(key, "chat", dict(CHAT), 100, record)


def test_the_edges_id_is_the_same_for_each_try_and_nothing_else_makes_one():
    edge_id = "0b9f4a52-5c1e-4f7e-9d6a-2f0e3c4b5a69"
    tag = edge_request_tag(edge_id, "1764000000123456")
    assert tag == edge_request_tag(edge_id.upper(), "1764000000123456") and len(tag) == 24
    assert id_time(f"k1-{tag}") == 1764000000_000  # filed under the second the edge had it
    assert tag != edge_request_tag("1b9f4a52-5c1e-4f7e-9d6a-2f0e3c4b5a69", "1764000000123456")
    for junk in (None, "", "x" * 36, edge_id + " ", edge_id[:-1], "k1-00000000" + "0" * 16):
        assert edge_request_tag(junk, "1764000000123456") == ""
    assert len(edge_request_tag(edge_id, "9" * 400)) == 24  # a stamp that is not the edge's: now


async def test_a_key_not_allowed_the_fallback_gets_the_original_503():
    access, _, gw, key = with_fallback(models=["big"])
    with pytest.raises(OpenAIError) as error:
        await chat(gw, key, {**CHAT, "model": "big"})
    assert error.value.status == 503 and error.value.code == "model_unavailable"
    assert [ticket.model for ticket in access.admitted] == ["big"]
    assert [status for status, _ in access.settled] == ["withdrawn"]


def test_a_fallback_must_be_a_configured_model():
    with pytest.raises(ValueError, match="fallback"):
        gateway({"big": Full()}, [ModelConfig(name="big", fallbacks=["nowhere"])])


# -- the outlier policy ---------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_failures_in_a_row_eject_a_replica_for_a_cool_down_then_probation():
    clock = Clock()
    ejector = OutlierEjector(eject_after=3, cool_down_s=10, clock=clock)
    ejector.forget_others(["a", "b"])
    assert not ejector.failed("a") and not ejector.failed("a")
    ejector.succeeded("a")  # a success clears the count
    assert not ejector.failed("a") and not ejector.failed("a")
    assert ejector.failed("a")  # the third in a row
    assert ejector.choices(["a", "b"]) == ["b"]
    clock.now = 10.5
    assert ejector.choices(["a", "b"]) == ["a", "b"]  # back, on probation
    assert ejector.failed("a")  # one failure on probation ejects it again
    clock.now = 30
    assert ejector.choices(["a", "b"]) == ["b"]  # for twice as long
    clock.now = 31
    ejector.succeeded("a")
    assert ejector.choices(["a", "b"]) == ["a", "b"]
    assert not ejector.failed("a")  # clean again: one failure is not enough


def test_the_last_replica_is_never_ejected_and_choices_are_never_empty():
    clock = Clock()
    ejector = OutlierEjector(eject_after=1, cool_down_s=10, clock=clock)
    ejector.forget_others(["a", "b"])
    assert ejector.failed("a")
    assert not ejector.failed("b")  # the only one left to choose
    assert ejector.choices(["b"]) == ["b"]
    assert ejector.choices(["a"]) == ["a"]  # only ejected candidates: the first back
    ejector.forget_others(["b"])  # a gone: forgotten
    assert ejector.ejected() == set()


def test_a_failure_without_a_replica_changes_nothing():
    ejector = OutlierEjector(eject_after=1)
    assert not ejector.failed("") and ejector.ejected() == set()


# -- the routers' filter ------------------------------------------------------------


def with_avoid(body, avoid):
    request = pending(body)
    request.kwargs[AVOID] = avoid
    return request


async def test_the_router_leaves_out_the_replicas_a_call_avoids_unless_none_is_left():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = router_with(a, b)
    queue(router, a, 0)
    queue(router, b, 0)
    body = {"messages": [{"role": "user", "content": "x" * 40}]}
    for avoided, expected in ((("a",), "b"), (("b",), "a")):
        ranks = await router.choose_replicas([a, b], with_avoid(body, avoided))
        assert [rid for rank in ids(ranks) for rid in rank] == [expected]
    everything = await router.choose_replicas([a, b], with_avoid(body, ("a", "b")))
    assert sorted(rid for rank in ids(everything) for rid in rank) == ["a", "b"]  # none left: all of them


async def test_the_router_leaves_out_replicas_its_process_ejected():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = router_with(a, b)
    queue(router, a, 0)
    queue(router, b, 0)
    ejector = OutlierEjector(eject_after=1)
    outliers._EJECTORS["model-m"] = ejector
    try:
        ejector.forget_others(["a", "b"])
        ejector.failed("a")
        ranks = await router.choose_replicas([a, b], pending({"messages": [{"role": "user", "content": "y"}]}))
        assert [rid for rank in ids(ranks) for rid in rank] == ["b"]
        result = object.__new__(type("Result", (), {}))
        router.on_request_routed(pending({}), b.replica_id, result)
        assert outliers.replica_of(result) == "b"  # the gateway learns which replica took its call
    finally:
        del outliers._EJECTORS["model-m"]
