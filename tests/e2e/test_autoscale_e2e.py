"""Autoscaling on the real stack: the LLM-aware policy wired into Ray Serve.

- Sustained streaming load takes the chat model from 1 to 2 replicas; when the
  load drops it returns to 1, and every stream in flight while a replica is
  stopped finishes (replicas drain before they stop). The load stays below
  the request-count target: only the engine's waiting queue, which replicas
  report to Serve's controller, can ask for the second replica.
- A scale-to-zero model has no replica until a request comes: that request
  waits for the cold start and is answered; idle again, the model goes back
  to zero. It is behind its direct route: at zero the edge sends its ``/v1``
  requests to the ingress (which wakes it and waits), then, once a replica is
  up, straight to that replica. A scale-to-zero model whose queue timeout is shorter than a start
  answers 503 `model_unavailable` with retry-after, costing the key nothing;
  the start that request set off runs while the other tests do (nobody waits
  for it), and that model is back at zero replicas by the module's end. That model
  has the chat model as its fallback (issue 78): a key that may use it is answered
  by the chat model meanwhile, at the chat model's prices, named in ``model`` and
  ``x-llm-fallback-from``; a key that may not gets the 503.

Delays are seconds here (minutes in production) so the module runs in a few
minutes; every replica takes a fraction of a CPU so two chat replicas and the
scale-to-zero models fit the box's two logical CPUs.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import redis as redis_sync
from http_checks import assert_error_envelope
from ports import free_port
from settled import wait_until_settled
from stack import APP_NAME, create_key, edge_server_stats, local_app_args, serve_stack
from streaming_load import StreamingLoad

from serve_app.pipeline.gateway import FALLBACK_FROM_HEADER
from serve_app.redis_store import redis_names

pytestmark = pytest.mark.e2e

CHAT, LAZY, IMPATIENT = "tiny-llama", "lazy-llama", "impatient-llama"
IMPATIENT_PRICING = {"prompt_per_million": 50.0, "completion_per_million": 200.0}
FAST_SCALING = {"target_ongoing_requests": 2, "upscale_delay_s": 2, "downscale_delay_s": 8, "look_back_period_s": 2}
STREAM = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 120,
    "temperature": 0,
    "extra_body": {"min_tokens": 120, "ignore_eos": True},
}


def _scale_to_zero_model(name: str, queue_timeout_s: float, base: dict) -> dict:
    return {
        **base,
        "name": name,
        "cpus_per_replica": 0.25,
        "deployment": {k: v for k, v in base["deployment"].items() if k != "num_replicas"},
        "autoscaling": {**FAST_SCALING, "min_replicas": 0, "max_replicas": 1, "downscale_delay_s": 5},
        "queue_timeout_s": queue_timeout_s,
    }


@pytest.fixture(scope="module")
def base_url(redis_server):
    # The ingress' path for CHAT and IMPATIENT (this module is about the ingress' handle:
    # its scale-up under load and its cold-start queue); LAZY scales from zero behind a
    # direct route, the shipped shape.
    args = {**local_app_args(ingress_path=True), "redis_url": redis_server.url}
    chat = next(model for model in args["models"] if model["name"] == CHAT)
    chat["deployment"] = {k: v for k, v in chat["deployment"].items() if k != "num_replicas"}
    chat["cpus_per_replica"] = 0.5
    args["models"] = [
        {**_scale_to_zero_model(LAZY, queue_timeout_s=240, base=chat), "direct_route": True},
        {
            **_scale_to_zero_model(IMPATIENT, queue_timeout_s=2, base=chat),
            "fallbacks": [CHAT],
            "pricing": IMPATIENT_PRICING,  # dearer than its fallback: which one charged shows
        },
    ]
    # Two sequences per engine step: more concurrent streams wait in the engine's
    # queue. 6 ongoing requests are under the target of 8 per replica.
    chat["engine_kwargs"] = {**chat["engine_kwargs"], "max_num_seqs": 2}
    chat["autoscaling"] = {**FAST_SCALING, "target_ongoing_requests": 8, "min_replicas": 1, "max_replicas": 2}
    args["models"].insert(0, chat)
    with serve_stack(args, port=free_port()) as url:
        yield url


@pytest.fixture(scope="module")
def key(base_url, redis_server):
    return create_key(redis_server.url, "autoscale", requests_per_minute=100_000, max_concurrent=100)


def running_replicas(model: str) -> int:
    return replica_states(model).get("RUNNING", 0)


def wait_for_replicas(model: str, wanted: int, timeout_s: float) -> float:
    """Seconds until ``model`` has exactly ``wanted`` running replicas."""
    start = time.monotonic()
    while running_replicas(model) != wanted:
        assert time.monotonic() - start < timeout_s, f"{model}: {running_replicas(model)} replicas, wanted {wanted}"
        time.sleep(0.5)
    return time.monotonic() - start


def wait_for_card(client, model: str, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while "capabilities" not in (card := client.models.retrieve(model).model_extra):
        assert time.monotonic() < deadline, card
        time.sleep(0.5)
    return card


def replica_states(model: str) -> dict[str, int]:
    from ray import serve

    from contract.model_config import deployment_name, direct_app_name

    app = direct_app_name(model) if model == LAZY else APP_NAME  # LAZY lives in its direct route's application
    return dict(serve.status().applications[app].deployments[deployment_name(model)].replica_states)


def one_hop_requests(model: str) -> tuple[int, list[str]]:
    """The requests HAProxy sent straight to ``model``'s direct route since its last
    reload, and its replicas' states there."""
    from contract.model_config import direct_app_name

    stats = edge_server_stats(f"http-{direct_app_name(model)}")
    replicas = {name: row for name, row in stats.items() if name not in ("BACKEND", "FRONTEND") and row["bck"] != "1"}
    return sum(int(row["stot"]) for row in replicas.values()), [row["status"] for row in replicas.values()]


# First: its cold start (which nobody waits for) overlaps the tests after it;
# the last test checks it went back to zero.
def test_cold_start_longer_than_the_queue_timeout_is_503_with_retry_after(base_url, redis_server):
    # A key that may not use the model's fallback: the model's own answer.
    key_id, secret = create_key(
        redis_server.url, "autoscale-no-fallback", requests_per_minute=1000, models=[IMPATIENT, LAZY]
    )
    assert running_replicas(IMPATIENT) == 0
    start = time.monotonic()
    response = httpx.post(
        base_url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {secret}"},
        json={"model": IMPATIENT, "messages": STREAM["messages"], "max_tokens": 4},
        timeout=60,
    )
    elapsed = time.monotonic() - start
    error = assert_error_envelope(response, 503)
    assert error["code"] == "model_unavailable" and error["type"] == "service_unavailable_error"
    assert int(response.headers["retry-after"]) >= 1
    assert 2 <= elapsed < 15, elapsed  # waited its 2 s bound, not the whole start
    redis = redis_sync.Redis.from_url(redis_server.url)
    records = wait_until_settled(redis, key_id)  # its slot is given back, off the response path
    # Nothing ran, nothing is charged: its admission was taken back (a tombstone, no
    # record) when the model's fallbacks were tried and the key may use none.
    found = [r for r in records if r.get("http_request_id") == response.headers["x-request-id"]]
    assert all(r["status"] in ("overloaded", "withdrawn") for r in found), found
    assert int(redis.hget(redis_names.usage(key_id), time.strftime("d:%Y%m%d:tokens", time.gmtime())) or 0) == 0
    # The request still woke the model: a replica is starting (or already up).
    assert sum(replica_states(IMPATIENT).values()) >= 1, replica_states(IMPATIENT)


def test_meanwhile_a_key_allowed_its_fallback_is_answered_by_it_at_its_prices(base_url, key, redis_server):
    key_id, secret = key
    assert running_replicas(IMPATIENT) == 0  # still starting (a start takes far longer than this module's first test)
    response = httpx.post(
        base_url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {secret}"},
        json={"model": IMPATIENT, "messages": STREAM["messages"], "max_tokens": 4},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.json()["model"] == CHAT and response.headers[FALLBACK_FROM_HEADER] == IMPATIENT
    redis = redis_sync.Redis.from_url(redis_server.url)
    records = wait_until_settled(redis, key_id)
    [record] = [r for r in records if r["http_request_id"] == response.headers["x-request-id"] and r.get("model")]
    assert record["status"] == "completed" and record["model"] == CHAT, record
    assert record["failover"] == f"fallback_from:{IMPATIENT}", record
    # Charged once, at the chat model's prices (configs/local.yaml: 0.10 and 0.40 per million).
    prompt, completion = int(record["prompt_tokens"]), int(record["completion_tokens"])
    today = time.strftime("d:%Y%m%d", time.gmtime())
    spent = int(redis.hget(redis_names.usage(key_id), f"{today}:cost_nanos"))
    assert spent == prompt * 100 + completion * 400, (spent, prompt, completion)
    assert int(redis.hget(redis_names.usage(key_id), f"{today}:requests")) == 1


def test_scale_to_zero_model_has_no_replica_until_a_request_waits_for_one(base_url, key):
    assert running_replicas(LAZY) == 0
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=key[1], max_retries=0, timeout=300)
    # Listing models does not wake it up; its card lacks what only a replica knows.
    cards = {card.id: card.model_extra for card in client.models.list().data}
    assert "capabilities" not in cards[LAZY] and cards[CHAT]["capabilities"] == [
        "chat",
        "completions",
        "messages",
        "responses",
    ]
    time.sleep(3)
    assert running_replicas(LAZY) == 0
    start = time.monotonic()
    reply = client.chat.completions.create(model=LAZY, messages=STREAM["messages"], max_tokens=4)
    waited = time.monotonic() - start
    assert reply.model == LAZY and reply.choices[0].message.content is not None
    assert running_replicas(LAZY) == 1
    print(f"\ncold start answered after {waited:.1f}s")
    # Up now: once HAProxy has its replica (Ray's next reload), /v1 takes the one hop to it.
    deadline = time.monotonic() + 60
    while (states := one_hop_requests(LAZY)[1]) != ["UP"]:
        assert time.monotonic() < deadline, states
        time.sleep(0.5)
    before = one_hop_requests(LAZY)[0]
    # A new connection: one kept alive from before the reload is still served by the old
    # HAProxy process, under the old config (Ray drains those over its close-spread-time).
    fresh = openai.OpenAI(base_url=base_url + "/v1", api_key=key[1], max_retries=0, timeout=300)
    fresh.chat.completions.create(model=LAZY, messages=STREAM["messages"], max_tokens=4)
    assert one_hop_requests(LAZY)[0] == before + 1
    card = wait_for_card(client, LAZY)  # learnt while its replica was up
    assert card["capabilities"] == ["chat", "completions", "messages", "responses"] and card["max_model_len"] == 2048
    # Idle again: back to zero after its downscale delay.
    wait_for_replicas(LAZY, 0, timeout_s=120)


def test_engine_queue_scales_up_and_idle_scales_down_without_failing_a_stream(base_url, key):
    assert running_replicas(CHAT) == 1
    load = StreamingLoad(base_url, key[1], CHAT, STREAM)
    try:
        load.add(6)  # 2 running + 4 waiting in the engine: saturated, though 6 < 8 ongoing
        up_s = wait_for_replicas(CHAT, 2, timeout_s=240)
        time.sleep(5)  # both replicas serve for a while
        load.remove(4)  # 2 ongoing: one replica is enough; streams stay in flight on both
        down_s = wait_for_replicas(CHAT, 1, timeout_s=240)
        time.sleep(3)
    finally:
        load.stop()
    print(f"\n1->2 replicas after {up_s:.0f}s of load, 2->1 after {down_s:.0f}s of less; streams {dict(load.outcomes)}")
    assert load.outcomes["error"] == 0, load.errors[:3]
    assert set(load.outcomes) == {"complete"}, load.outcomes
    assert load.outcomes["complete"] >= 10


def test_a_woken_model_nobody_uses_goes_back_to_zero(base_url):
    # The impatient model's replica, started by the refused request of the first
    # test, had nobody waiting: it went back to zero (long since, by now).
    deadline = time.monotonic() + 180
    while any(replica_states(IMPATIENT).values()):
        assert time.monotonic() < deadline, replica_states(IMPATIENT)
        time.sleep(0.5)
