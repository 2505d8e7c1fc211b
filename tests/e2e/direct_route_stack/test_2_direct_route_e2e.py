"""A model's direct route (``direct_route``, serve_app/http/direct.py): its replicas
answer HTTP themselves at /direct/<model>, behind HAProxy, with the gateway's
keys, quotas and accounting in-process; the ingress reaches the same
deployment for every other route. Real Redis, Ray Serve, vLLM CPU engine; the
openai SDK and httpx as clients.

Each test asserts what a tenant would exploit if the in-process gateway were
weaker than the ingress: what was charged in Redis, what the engine still
runs, which leases are held, across both routes of one key."""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import json
import time

import httpx
import openai
import openai_spec
import pytest
from dense_prompts import burst, dense, estimate
from http_checks import assert_error_envelope
from ports import free_port
from settled import assert_within_reservations, counters, wait_until_settled
from stack import call_replica, create_key

from contract.model_config import direct_app_name, direct_route_prefix
from direct_route_stack.stack_args import LEASE_S, MODEL
from serve_app.redis_store import redis_names

pytestmark = pytest.mark.e2e

HELLO = [{"role": "user", "content": "Tell me about the license."}]
# The ingress' way to this model's chat: /v1 requests for it take the edge's one hop to
# the direct route (cluster/haproxy_edge.py), Azure's route is the ingress' alone.
INGRESS_CHAT = "/models/chat/completions"


@pytest.fixture(scope="module")
def direct_url(base_url):
    return base_url + direct_route_prefix(MODEL)


def post(url, secret, path, body) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120, headers={"authorization": f"Bearer {secret}"})


def charged(redis, key_id) -> int:
    day = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    return int(redis.hget(redis_names.usage(key_id), f"d:{day}:tokens") or 0)


def long_stream(url: str, secret: str):
    """A streamed chat of 1,900 tokens (about 3 s on an idle 2-core box, longer under load)."""
    request = {"model": MODEL, "messages": HELLO, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    return httpx.stream(
        "POST", url + "/v1/chat/completions", json=request, timeout=120, headers={"authorization": f"Bearer {secret}"}
    )


def hang_up_mid_stream(url: str, secret: str) -> None:
    """Open a long stream and hang up 5 events into its 1,900 tokens."""
    with long_stream(url, secret) as gone:
        assert gone.status_code == 200
        received = 0
        for line in gone.iter_lines():
            received += line.startswith("data: {")
            if received >= 5:
                break


SHORT = {"model": MODEL, "messages": HELLO, "max_tokens": 2}


def engine_unfinished() -> int:
    return call_replica(MODEL, "engine_load", app_name=direct_app_name(MODEL))["unfinished"]


def test_the_direct_route_answers_as_the_ingress_does_and_charges_once(base_url, direct_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "direct-same", requests_per_minute=100)
    request = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": 12,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    direct = openai.OpenAI(base_url=direct_url + "/v1", api_key=secret, max_retries=0, timeout=120)
    ingress = openai.OpenAI(
        base_url=base_url + "/models",
        api_key=secret,
        max_retries=0,
        timeout=120,
        default_headers={"extra-parameters": "pass-through"},
    )  # Azure's word for vLLM's own

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

    completion = direct.completions.create(
        model=MODEL, prompt="The license", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 5

    found = wait_until_settled(redis, key_id, records_expected=4)
    assert sorted(r["status"] for r in found) == ["completed"] * 4
    used = answer.usage.total_tokens + by_ingress.usage.total_tokens + chunks[-1].usage.total_tokens
    assert charged(redis, key_id) == used + completion.usage.total_tokens  # each request once, what it used


def answered() -> int:
    """The requests the direct route's replica answered over HTTP since it started."""
    return sum(call_replica(MODEL, "answered", app_name=direct_app_name(MODEL)).values())


def test_v1_requests_naming_the_model_take_one_hop_to_its_direct_route(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "one-hop", requests_per_minute=100)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=120)
    before = answered()
    chat = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert chat.headers["x-ratelimit-remaining-requests"] == "99"  # admitted by the key's quota
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    # One naming its session: placed by the edge's session backend (cluster/haproxy_edge.py).
    completion = client.completions.create(
        model=MODEL,
        prompt="The license",
        max_tokens=3,
        extra_body={"ignore_eos": True},
        extra_headers={"x-session-id": "s-1"},
    )
    assert answered() - before == 3  # each answered by the model's replica itself, none by the ingress
    assert chat.parse().usage.completion_tokens == 6 and completion.usage.completion_tokens == 3
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # A body the edge could not read a model from goes to the ingress, which answers as before.
    broken = httpx.post(
        base_url + "/v1/chat/completions",
        content=b'{"model": "%s", "messages": [' % MODEL.encode(),
        headers={"authorization": f"Bearer {secret}", "content-type": "application/json"},
        timeout=60,
    )
    assert assert_error_envelope(broken, 400)["message"]
    listed = post(base_url, secret, "/v1/chat/completions", {"model": [MODEL], "messages": HELLO})
    assert assert_error_envelope(listed, 400)["param"] == "model"
    unknown = post(base_url, secret, "/v1/chat/completions", {"model": MODEL + "-x", "messages": HELLO})
    assert assert_error_envelope(unknown, 404)
    # Two names for the model: the edge reads the first, the gateway the last; refused, never run.
    twice = httpx.post(
        base_url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {secret}"},
        timeout=60,
        content=b'{"model": "%s", "model": "%s-x", "messages": []}' % (MODEL.encode(), MODEL.encode()),
    )
    assert twice.status_code in (400, 404), twice.text
    found = wait_until_settled(redis, key_id, records_expected=3)
    assert sorted(r["status"] for r in found) == ["completed"] * 3  # the refused left no record
    used = chat.parse().usage.total_tokens + chunks[-1].usage.total_tokens + completion.usage.total_tokens
    assert charged(redis, key_id) == used  # each once, what it used


def test_models_lists_what_the_key_may_use(direct_url, redis_server):
    _, secret = create_key(redis_server.url, "direct-models")
    listed = httpx.get(direct_url + "/v1/models", headers={"authorization": f"Bearer {secret}"}, timeout=60)
    openai_spec.validate(listed.json(), "ListModelsResponse")
    assert [m["id"] for m in listed.json()["data"]] == [MODEL]
    _, other = create_key(redis_server.url, "direct-other-model", models=["minilm"])
    assert (
        httpx.get(direct_url + "/v1/models", headers={"authorization": f"Bearer {other}"}, timeout=60).json()["data"]
        == []
    )


def test_no_key_a_wrong_key_or_a_model_not_allowed_never_reach_the_engine(direct_url, redis_server, redis):
    request = {"model": MODEL, "messages": HELLO, "max_tokens": 4}
    assert_error_envelope(httpx.post(direct_url + "/v1/chat/completions", json=request, timeout=60), 401)
    assert_error_envelope(post(direct_url, "sk-not-a-key", "/v1/chat/completions", request), 401)
    key_id, secret = create_key(redis_server.url, "direct-not-allowed", models=["minilm"])
    error = assert_error_envelope(post(direct_url, secret, "/v1/chat/completions", request), 404)
    assert error["code"] == "model_not_found"  # the answer for a model that does not exist
    # Another model by name on this model's route: not served here, whatever the key.
    _, unlimited = create_key(redis_server.url, "direct-wrong-model")
    error = assert_error_envelope(
        post(direct_url, unlimited, "/v1/chat/completions", {**request, "model": "minilm"}), 404
    )
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
    assert (
        post(
            direct_url, secret, "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 2}
        ).status_code
        == 200
    )


def test_a_body_past_the_limit_is_a_413_before_it_is_read(direct_url, redis_server):
    _, secret = create_key(redis_server.url, "direct-huge")
    huge = b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "' + b"a" * 9_000_000 + b'"}]}'
    response = httpx.post(
        direct_url + "/v1/chat/completions",
        content=huge,
        timeout=60,
        headers={"authorization": f"Bearer {secret}", "content-type": "application/json"},
    )
    assert assert_error_envelope(response, 413)["code"] == "request_too_large"


def test_a_key_limit_is_one_limit_across_the_direct_route_and_the_ingress(base_url, direct_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "direct-rpm", requests_per_minute=3)
    request = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    statuses = [
        post(url, secret, path, request)
        for url, path in (
            (direct_url, "/v1/chat/completions"),
            (base_url, INGRESS_CHAT),
            (base_url, "/v1/chat/completions"),
            (base_url, INGRESS_CHAT),
            (direct_url, "/v1/chat/completions"),
        )
    ]
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
    hang_up_mid_stream(direct_url, secret)
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


# -- streams started before their admission (serve_app/admission/overlap.py) ---------------
# Only while the model is busy (another request of it in flight on the replica):
# each test below holds a long stream of another key open meanwhile.

STREAMED = {
    "model": MODEL,
    "messages": HELLO,
    "max_tokens": 4,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def stream_chat(url: str, secret: str) -> tuple[int, dict | None]:
    """(status, the stream's usage) of one streamed chat, read to its end."""
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=STREAMED, timeout=120, headers={"authorization": f"Bearer {secret}"}
    ) as response:
        usage = None
        for line in response.iter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = json.loads(line[len("data: ") :]).get("usage") or usage
        return response.status_code, usage


@contextlib.contextmanager
def model_busy(direct_url: str, redis_server):
    """A long stream of another key in flight on the replica (hung up on at the end)."""
    _, other = create_key(redis_server.url, f"direct-busy-{free_port()}")
    with long_stream(direct_url, other) as busy:
        assert busy.status_code == 200
        lines = busy.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)
        yield


def early_starts() -> dict[str, int]:
    """Streams the replica sent to its engine before their admission returned, by outcome."""
    return call_replica(MODEL, "early_starts", app_name=direct_app_name(MODEL))


def prompts_resized() -> int:
    """Prompts the replica rendered past their estimate, each admitted again at its real size."""
    return call_replica(MODEL, "prompts_resized", app_name=direct_app_name(MODEL))


def engine_prompt_tokens() -> int:
    """Prompt tokens the engine has scheduled since it started (its prefix-cache lookups)."""
    return call_replica(MODEL, "engine_load", app_name=direct_app_name(MODEL))["prefix_cache_queries"]


def engine_prompt_tokens_after_a_marker(direct_url: str, redis_server) -> int:
    """The engine's prompt tokens scheduled so far, less a marker's: a stream of another
    key sent now and waited for in the engine's stats. What the engine took before the
    marker is counted by then (its stats follow its steps in order), so "it took
    nothing" is read after a positive signal, never after a fixed sleep."""
    before = engine_prompt_tokens()
    _, marker = create_key(redis_server.url, f"direct-marker-{free_port()}")
    status, usage = stream_chat(direct_url, marker)
    assert status == 200 and usage is not None
    deadline = time.monotonic() + 30
    while (now := engine_prompt_tokens()) < before + usage["prompt_tokens"]:
        assert time.monotonic() < deadline, "the marker's prompt never reached the engine's stats"
        time.sleep(0.1)
    return now - usage["prompt_tokens"]


def wait_engine_idle() -> None:
    deadline = time.monotonic() + 30
    while engine_unfinished():
        assert time.monotonic() < deadline, "the engine still runs requests nobody is waiting for"
        time.sleep(0.2)


def test_a_flood_past_a_limit_spent_elsewhere_starts_no_more_than_the_room_redis_reported(
    base_url, direct_url, redis_server, redis
):
    # The direct replica learns the key's room from its own admissions; the rest of
    # the limit is then spent through the ingress, so what the replica believes is stale.
    key_id, secret = create_key(redis_server.url, "direct-flood", requests_per_minute=4)
    streamed = [stream_chat(direct_url, secret) for _ in range(2)]  # Redis reports 2 left
    assert [status for status, _ in streamed] == [200, 200]
    prompt = streamed[0][1]["prompt_tokens"]
    unary = [post(base_url, secret, INGRESS_CHAT, SHORT) for _ in range(2)]
    assert [r.status_code for r in unary] == [200, 200]  # the limit is spent
    wait_engine_idle()
    with model_busy(direct_url, redis_server):
        seen, before = engine_prompt_tokens(), early_starts()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            flood = list(pool.map(lambda _: stream_chat(direct_url, secret), range(8)))
        assert [status for status, _ in flood] == [429] * 8
        withdrawn = early_starts()["withdrawn"] - before["withdrawn"]
        assert 1 <= withdrawn <= 2, f"{withdrawn} of the flood started ahead of Redis' answer (it reported room for 2)"
        assert early_starts()["admitted"] == before["admitted"]
        started = engine_prompt_tokens_after_a_marker(direct_url, redis_server) - seen
        assert started <= 2 * prompt, f"the engine took {started} prompt tokens of a refused flood"
        # Refused: no stream of this key starts ahead of its admission any more.
        seen, before = engine_prompt_tokens(), early_starts()
        assert [stream_chat(direct_url, secret)[0] for _ in range(4)] == [429] * 4
        assert early_starts() == before
        assert engine_prompt_tokens_after_a_marker(direct_url, redis_server) == seen
    wait_engine_idle()  # the two it may have started ahead of Redis' answer were aborted
    found = wait_until_settled(redis, key_id, records_expected=4)
    assert sorted(r["status"] for r in found) == ["completed"] * 4  # refused requests leave no record
    used = sum(usage["total_tokens"] for _, usage in streamed) + sum(r.json()["usage"]["total_tokens"] for r in unary)
    assert charged(redis, key_id) == used  # charged what the four admitted used, nothing for the flood


def assert_each_charged_once(redis, key_id: str, results: list[tuple[int, dict]]) -> None:
    """Every stream of ``results`` made its 4 tokens and was charged once, what it
    reported: one completed record each (one id per request), no lease left behind."""
    assert all(usage["completion_tokens"] == 4 for _, usage in results)
    found = wait_until_settled(redis, key_id, records_expected=len(results))
    assert sorted(r["status"] for r in found) == ["completed"] * len(results)
    assert charged(redis, key_id) == sum(usage["total_tokens"] for _, usage in results)
    assert redis.zcard(redis_names.concurrency(key_id)) == 0


def test_streams_started_before_admission_are_charged_once_under_one_id(direct_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "direct-early")  # no limit: room for every guess
    results = [stream_chat(direct_url, secret)]  # Redis has admitted the key on this replica
    before = early_starts()
    with model_busy(direct_url, redis_server):
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results += pool.map(lambda _: stream_chat(direct_url, secret), range(8))
    assert [status for status, _ in results] == [200] * 9
    assert early_starts()["admitted"] - before["admitted"] == 8  # every one of them started early
    assert_each_charged_once(redis, key_id, results)


def test_on_an_idle_model_streams_start_beside_their_admission(direct_url, redis_server, redis):
    """quota.overlap_admission_when_idle (on by default): a lone stream on an idle
    engine, and each of a burst, goes to the engine while Redis decides."""
    key_id, secret = create_key(redis_server.url, "direct-idle")  # no limit: room for every guess
    results = [stream_chat(direct_url, secret)]  # Redis has admitted the key on this replica
    wait_engine_idle()
    before = early_starts()
    results.append(stream_chat(direct_url, secret))
    assert early_starts()["admitted"] - before["admitted"] == 1  # alone on an idle engine, started early
    wait_engine_idle()
    before = early_starts()
    # Redis holds the burst's admissions (within the gateway's Redis timeout): each
    # one is in the engine meanwhile, none waits for another's admission.
    redis.execute_command("CLIENT", "PAUSE", 200, "ALL")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results += pool.map(lambda _: stream_chat(direct_url, secret), range(8))
    assert [status for status, _ in results] == [200] * 10
    assert early_starts()["admitted"] - before["admitted"] == 8
    assert early_starts()["withdrawn"] == before["withdrawn"]
    assert_each_charged_once(redis, key_id, results)


def test_a_client_gone_from_a_stream_started_before_admission_stops_the_engine(direct_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "direct-early-gone")
    assert stream_chat(direct_url, secret)[0] == 200  # Redis has admitted the key here: the next starts early
    before = early_starts()
    with model_busy(direct_url, redis_server):
        hang_up_mid_stream(direct_url, secret)
    assert early_starts()["admitted"] == before["admitted"] + 1
    wait_engine_idle()  # both hung up on: vLLM aborted both
    found = wait_until_settled(redis, key_id, records_expected=2)
    assert sorted(r["status"] for r in found) == ["cancelled", "completed"], found


def tokens_per_chunk(url: str, secret: str, tokens: int) -> tuple[list[int], dict]:
    """How many tokens each chunk of a streamed chat carried (by its logprobs, one
    per token), and the stream's usage."""
    request = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "logprobs": True,
        "stream_options": {"include_usage": True},
    }
    counts, usage = [], None
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=request, timeout=120, headers={"authorization": f"Bearer {secret}"}
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: ") :])
                usage = event.get("usage") or usage
                counts += [
                    len(c["logprobs"]["content"]) for c in event["choices"] if (c.get("logprobs") or {}).get("content")
                ]
    return counts, usage


def test_beside_other_streams_a_chunk_carries_several_tokens_and_none_is_lost(direct_url, redis_server, redis):
    """stream_batch_tokens (4): vLLM builds one chunk per 4 tokens of a stream that
    shares its replica, never holding the first; a lone stream gets its tokens one by one."""
    key_id, secret = create_key(redis_server.url, "direct-batched")
    alone, alone_usage = tokens_per_chunk(direct_url, secret, 24)
    assert sum(alone) == alone_usage["completion_tokens"] == 24
    assert alone.count(1) > len(alone) / 2, alone  # vLLM joins only what its reader left behind
    with model_busy(direct_url, redis_server):
        beside, usage = tokens_per_chunk(direct_url, secret, 24)
    assert sum(beside) == usage["completion_tokens"] == 24, beside
    assert beside[0] == 1, beside  # the first token is never held
    assert all(count >= 4 for count in beside[1:-1]), beside
    found = wait_until_settled(redis, key_id, records_expected=2)
    assert [r["status"] for r in found] == ["completed"] * 2
    assert charged(redis, key_id) == alone_usage["total_tokens"] + usage["total_tokens"]


def test_dense_prompts_on_v1_never_pass_a_budget_whether_they_start_early_or_not(base_url, redis_server, redis):
    """The one hop /v1 ships: streams of prompts four times denser than their estimate,
    some started in the engine beside their admission, are refused at their estimate by
    the in-process replica and admitted again at their real size, never past the budget."""
    budget = 5_000
    key_id, secret = create_key(redis_server.url, "direct-dense", daily_token_budget=budget)
    # One small stream first: the replica learns the key's room from its own admissions,
    # and starts a stream early only where it knows there is room.
    status, first = stream_chat(base_url, secret)
    assert status == 200 and first is not None
    prompts = [dense("emoji", 400, seed=1), dense("digits", 1200, seed=2)]
    before, resized_before = early_starts(), prompts_resized()
    answered = burst(base_url, [secret], prompts, max_tokens=100, model=MODEL, stream=True)
    started_early = sum(early_starts().values()) - sum(before.values())
    # Some start early (how many depends on when each admission's answer tells the replica
    # the key's room: all 16 may, one after another); the budget below holds either way.
    assert started_early >= 1, f"{started_early} of the burst's 16 streams started early"
    # Every prompt answered rendered past its estimate: refused by the replica at it and
    # admitted again at its real size (the path this test is about, not only its outcome).
    resized = prompts_resized() - resized_before
    assert resized >= len(answered) > 0, (resized, len(answered))
    assert_within_reservations(wait_until_settled(redis, key_id))
    charged = counters(redis, key_id)
    assert answered and all(usage.prompt_tokens > estimate(prompts[0]) for usage in answered)
    assert charged["tokens"] == first["total_tokens"] + sum(usage.total_tokens for usage in answered)
    assert charged["tokens"] <= budget, (charged, len(answered))
