"""Ingress operations that wait on a replica are bounded (the replica side is
faked: a model whose replicas never take the call), and readiness follows what
Serve reports and whether a replica answered."""

import asyncio
import time
from types import SimpleNamespace

import pytest
from cache_secret import salts

from contract.model_config import ModelConfig
from serve_app.errors import OpenAIError
from serve_app.http.readiness import Readiness
from serve_app.identity.keys import KeyRecord
from serve_app.pipeline.gateway import Gateway
from serve_app.telemetry import Telemetry

QUEUE_TIMEOUT_S = 0.3


class NeverAssigned:
    """A call no replica takes (all busy, or none up): awaiting assignment never ends."""

    def __init__(self, calls):
        self.cancelled = False
        calls.append(self)

    async def _fetch_future_result_async(self):
        await asyncio.sleep(3600)

    def cancel(self):
        self.cancelled = True


class Answers:
    def __init__(self, calls):
        calls.append(self)

    async def _fetch_future_result_async(self):
        return None

    def __await__(self):
        async def info():
            return {"max_model_len": 256, "operations": ["chat", "completions"]}

        return info().__await__()


def gateway_with(response_class, names=("a", "b")):
    calls = []
    handle = SimpleNamespace(model_info=SimpleNamespace(remote=lambda: response_class(calls)))
    configs = [ModelConfig(name=n, queue_timeout_s=QUEUE_TIMEOUT_S) for n in names]
    gateway = Gateway(SimpleNamespace(), {n: handle for n in names}, configs, Telemetry(False, False), salts())
    return gateway, calls


KEY = KeyRecord(id="k1", name="n", created_at=0)


async def test_listing_models_whose_replicas_never_answer_takes_one_queue_timeout():
    gateway, calls = gateway_with(NeverAssigned)
    started = time.monotonic()
    cards = await gateway.catalog.model_cards(KEY)
    took = time.monotonic() - started
    assert [c["id"] for c in cards] == ["a", "b"] and "max_model_len" not in cards[0]
    assert took < 2 * QUEUE_TIMEOUT_S + 0.2  # side by side, not one after another
    await asyncio.sleep(0.05)
    assert all(call.cancelled for call in calls)  # withdrawn from Serve's queue


async def test_many_callers_share_one_description_call():
    gateway, calls = gateway_with(NeverAssigned, names=("a",))
    await asyncio.gather(*(gateway.catalog.model_card("a") for _ in range(50)))
    assert len(calls) == 1


async def test_a_model_less_dialect_call_is_bounded_too():
    gateway, _ = gateway_with(NeverAssigned)
    started = time.monotonic()
    with pytest.raises(OpenAIError) as caught:
        await gateway.catalog.only_model_for("chat")  # two models, neither described: ask for one
    assert caught.value.status == 400 and time.monotonic() - started < 2 * QUEUE_TIMEOUT_S + 0.2


async def test_databricks_truncate_on_an_undescribed_model_is_a_503_not_a_crash():
    from serve_app.dialects import databricks

    gateway, _ = gateway_with(NeverAssigned, names=("a",))
    with pytest.raises(OpenAIError) as caught:
        await databricks.translate("a", {"prompt": "hi", "error_behavior": "truncate"}, gateway.catalog)
    assert caught.value.status == 503 and caught.value.headers["retry-after"]


async def test_details_learnt_once_a_replica_answers():
    gateway, calls = gateway_with(Answers, names=("a",))
    card = await gateway.catalog.model_card("a")
    assert card["max_model_len"] == 256 and gateway.catalog.described("a")


async def test_descriptions_go_through_their_own_handles_never_the_clients_queue():
    # Serve counts max_queued_requests per router: a description queued behind a
    # busy replica on the clients' handle took the one queue slot of a narrow model.
    calls = []

    def clients_queue():
        raise AssertionError("a description went through the handle clients are queued on")

    clients = SimpleNamespace(model_info=SimpleNamespace(remote=clients_queue))
    own = SimpleNamespace(model_info=SimpleNamespace(remote=lambda: Answers(calls)))
    gateway = Gateway(
        SimpleNamespace(),
        {"a": clients},
        [ModelConfig(name="a")],
        Telemetry(False, False),
        salts(),
        describers={"a": own},
    )
    card = await gateway.catalog.model_card("a")
    assert card["max_model_len"] == 256 and len(calls) == 1


class StubReadiness(Readiness):
    def __init__(self, configs, running, described):
        super().__init__(configs, {c.name: f"model-{c.name}" for c in configs}, lambda n: n in described)
        self.running, self.reads = running, 0

    def _read_status(self):
        self.reads += 1
        return self.running


async def test_ready_only_when_every_kept_up_model_runs_and_answered():
    configs = [ModelConfig(name="qwerty"), ModelConfig(name="z", autoscaling={"min_replicas": 0, "max_replicas": 1})]
    assert configs[1].scales_to_zero
    probe = StubReadiness(configs, {"qwerty": 0}, described=set())
    assert (await probe.check()) == (False, {"status": "starting", "models_ready": 0, "models": 1})
    probe = StubReadiness(configs, {"qwerty": 1}, described=set())
    assert not (await probe.check())[0]  # running, but no call answered yet
    probe = StubReadiness(configs, {"qwerty": 1}, described={"qwerty"})
    ready, body = await probe.check()
    assert ready and "qwerty" not in str(body)  # unauthenticated: no model names


async def test_a_flood_of_probes_reads_serve_status_once_per_ttl():
    probe = StubReadiness([ModelConfig(name="a")], {"a": 1}, described={"a"})
    await asyncio.gather(*(probe.check() for _ in range(200)))
    assert probe.reads == 1
