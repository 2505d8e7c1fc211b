"""A model's direct route (``direct_route``, serve_app/direct.py): its replicas
answer HTTP themselves at /direct/<model>, behind HAProxy, with the gateway's
keys, quotas and accounting in-process; the ingress reaches the same
deployment for every other route. Real Redis, Ray Serve, vLLM CPU engine; the
openai SDK and httpx as clients.

Each test asserts what a tenant would exploit if the in-process gateway were
weaker than the ingress: what was charged in Redis, what the engine still
runs, which leases are held, across both routes of one key."""

from __future__ import annotations

import datetime
import time

import httpx
import openai
import pytest

import openai_spec
from contract.model_config import direct_app_name, direct_route_prefix
from http_checks import assert_error_envelope, free_port
from serve_app import redis_names
from settled import wait_until_settled
from stack import call_replica, create_key, local_app_args, serve_stack

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
LEASE_S = 1.0  # short: a stream outliving it holds its place only if the replica renews it
HELLO = [{"role": "user", "content": "Tell me about the license."}]


@pytest.fixture(scope="module")
def base_url(redis_server):
    args = local_app_args(only=[MODEL])
    args["redis_url"] = redis_server.url
    args["models"][0]["direct_route"] = True
    args["quota"] = {"concurrency_lease_s": LEASE_S}
    with serve_stack(args, port=free_port()) as url:
        deadline = time.monotonic() + 300
        while httpx.get(url + "/ready", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the stack never became ready"
            time.sleep(0.5)
        yield url


@pytest.fixture(scope="module")
def direct_url(base_url):
    return base_url + direct_route_prefix(MODEL)


def post(url, secret, path, body) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120, headers={"authorization": f"Bearer {secret}"})


def charged(redis, key_id) -> int:
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    return int(redis.hget(redis_names.usage(key_id), f"d:{day}:tokens") or 0)


def long_stream(url: str, secret: str):
    """A streamed chat of 1,900 tokens (about 3 s on an idle 2-core box, longer under load)."""
    request = {"model": MODEL, "messages": HELLO, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    return httpx.stream("POST", url + "/v1/chat/completions", json=request, timeout=120,
                        headers={"authorization": f"Bearer {secret}"})


SHORT = {"model": MODEL, "messages": HELLO, "max_tokens": 2}


def engine_unfinished() -> int:
    return call_replica(MODEL, "engine_load", app_name=direct_app_name(MODEL))["unfinished"]


def test_the_direct_route_answers_as_the_ingress_does_and_charges_once(base_url, direct_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "direct-same", requests_per_minute=100)
    request = {"model": MODEL, "messages": HELLO, "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    direct = openai.OpenAI(base_url=direct_url + "/v1", api_key=secret, max_retries=0, timeout=120)
    ingress = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=120)

    by_direct = direct.chat.completions.with_raw_response.create(**request)
    openai_spec.validate(by_direct.http_response.json(), "CreateChatCompletionResponse")
    assert by_direct.headers["x-ratelimit-limit-requests"]  # the gateway's headers, from the replica
    answer = by_direct.parse()
    by_ingress = ingress.chat.completions.create(**request)
    assert answer.choices[0].message.content == by_ingress.choices[0].message.content
    assert answer.usage.completion_tokens == 12 == by_ingress.usage.completion_tokens

    streamed = direct.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12

    completion = direct.completions.create(model=MODEL, prompt="The license", max_tokens=5,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 5

    found = wait_until_settled(redis, key_id, records_expected=4)
    assert sorted(r["status"] for r in found) == ["completed"] * 4
    used = answer.usage.total_tokens + by_ingress.usage.total_tokens + chunks[-1].usage.total_tokens
    assert charged(redis, key_id) == used + completion.usage.total_tokens  # each request once, what it used


def test_models_lists_what_the_key_may_use(direct_url, redis_server):
    _, secret = create_key(redis_server.url, "direct-models")
    listed = httpx.get(direct_url + "/v1/models", headers={"authorization": f"Bearer {secret}"}, timeout=60)
    openai_spec.validate(listed.json(), "ListModelsResponse")
    assert [m["id"] for m in listed.json()["data"]] == [MODEL]
    _, other = create_key(redis_server.url, "direct-other-model", models=["minilm"])
    assert httpx.get(direct_url + "/v1/models", headers={"authorization": f"Bearer {other}"},
                     timeout=60).json()["data"] == []


def test_no_key_a_wrong_key_or_a_model_not_allowed_never_reach_the_engine(direct_url, redis_server, redis):
    request = {"model": MODEL, "messages": HELLO, "max_tokens": 4}
    assert_error_envelope(httpx.post(direct_url + "/v1/chat/completions", json=request, timeout=60), 401)
    assert_error_envelope(post(direct_url, "sk-not-a-key", "/v1/chat/completions", request), 401)
    key_id, secret = create_key(redis_server.url, "direct-not-allowed", models=["minilm"])
    error = assert_error_envelope(post(direct_url, secret, "/v1/chat/completions", request), 403)
    assert error["code"] == "model_not_allowed"
    # Another model by name on this model's route: not served here, whatever the key.
    _, unlimited = create_key(redis_server.url, "direct-wrong-model")
    error = assert_error_envelope(post(direct_url, unlimited, "/v1/chat/completions", {**request, "model": "minilm"}), 404)
    assert error["param"] == "model"
    assert charged(redis, key_id) == 0 and not wait_until_settled(redis, key_id)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": HELLO, "max_tokens": "1000"}, "max_tokens"),
        ({"messages": HELLO, "max_tokens": 10**30}, "max_tokens"),
        ({"messages": HELLO, "max_tokens": 1000.0}, "max_tokens"),
        ({"messages": HELLO, "max_tokens": 2, "n": "4"}, "n"),
    ],
)
def test_bad_input_is_a_400_naming_it_and_leaves_nothing(direct_url, redis_server, redis, body, param):
    key_id, secret = create_key(redis_server.url, f"direct-bad-{free_port()}", max_concurrent=1)
    error = assert_error_envelope(post(direct_url, secret, "/v1/chat/completions", {"model": MODEL, **body}), 400)
    assert error["param"] == param, error
    assert charged(redis, key_id) == 0
    assert redis.zcard(redis_names.concurrency(key_id)) == 0
    assert post(direct_url, secret, "/v1/chat/completions", {"model": MODEL, "messages": HELLO,
                                                             "max_tokens": 2}).status_code == 200


def test_a_body_past_the_limit_is_a_413_before_it_is_read(direct_url, redis_server):
    _, secret = create_key(redis_server.url, "direct-huge")
    huge = b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "' + b"a" * 9_000_000 + b'"}]}'
    response = httpx.post(direct_url + "/v1/chat/completions", content=huge, timeout=60,
                          headers={"authorization": f"Bearer {secret}", "content-type": "application/json"})
    assert assert_error_envelope(response, 413)["code"] == "request_too_large"


def test_a_key_limit_is_one_limit_across_the_direct_route_and_the_ingress(base_url, direct_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "direct-rpm", requests_per_minute=3)
    request = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    statuses = [post(url, secret, "/v1/chat/completions", request)
                for url in (direct_url, base_url, direct_url, base_url, direct_url)]
    assert [r.status_code for r in statuses] == [200, 200, 200, 429, 429], [r.text for r in statuses]
    refused = assert_error_envelope(statuses[-1], 429)
    assert refused["type"] == "requests" and int(statuses[-1].headers["retry-after"]) >= 1
    found = wait_until_settled(redis, key_id, records_expected=3)
    assert len(found) == 3


def test_a_stream_outliving_its_lease_holds_the_keys_only_place(direct_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "direct-long", max_concurrent=1)
    with long_stream(direct_url, secret) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        next(lines)
        time.sleep(LEASE_S * 1.6)  # the replica renews the lease, or the key's place would be free again
        assert engine_unfinished() == 1  # still generating
        second = post(direct_url, secret, "/v1/chat/completions", SHORT)
        assert assert_error_envelope(second, 429)["type"] == "concurrency"
        for _ in lines:
            pass
    wait_until_settled(redis, key_id, records_expected=1)


def test_a_client_gone_mid_stream_stops_the_engine_and_frees_its_place(direct_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "direct-gone", max_concurrent=1)
    with long_stream(direct_url, secret) as gone:
        assert gone.status_code == 200
        received = 0
        for line in gone.iter_lines():
            received += line.startswith("data: {")
            if received >= 5:
                break  # and hang up, 5 events into 1,900 tokens
    deadline = time.monotonic() + 20
    while engine_unfinished():  # vLLM aborted it: the engine does not go on generating for nobody
        assert time.monotonic() < deadline, "the engine still runs the request of a client that left"
        time.sleep(0.2)
    found = wait_until_settled(redis, key_id, records_expected=1)
    assert [r["status"] for r in found] == ["cancelled"], found
    # A cancelled stream keeps its reservation charged (its tokens were made, never counted).
    assert charged(redis, key_id) >= 1900
    again = post(direct_url, secret, "/v1/chat/completions", SHORT)
    assert again.status_code == 200  # its only place came back
