"""Keys, quotas, 429s and request state end to end: real Redis, Ray Serve with two
ingress replicas, the vLLM CPU engine, the openai SDK (the package's stack:
stack_args.py)."""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import openai_spec
import pytest
from settled import assert_within_reservations, wait_until_settled
from stack import create_key

from quota_stack.stack_args import ADMIN, CACHE_TTL_S, MODEL
from serve_app.redis_store import redis_names

pytestmark = pytest.mark.e2e

HELLO = [{"role": "user", "content": "Tell me about the license."}]


def sdk(base_url, secret, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=secret, **{"max_retries": 0, "timeout": 120, **options})


def post_chat(base_url, secret, body, header="authorization") -> httpx.Response:
    value = f"Bearer {secret}" if header == "authorization" else secret
    return httpx.post(base_url + "/v1/chat/completions", json=body, headers={header: value}, timeout=120)


def chat_body(**extra) -> dict:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 2, **extra}


def assert_429(response: httpx.Response, error_type: str, code: str = "rate_limit_exceeded") -> dict:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["type"] == error_type and error["code"] == code, error
    assert set(error) == {"message", "type", "param", "code"}
    return error


# -- authentication ------------------------------------------------------------


def test_missing_or_wrong_key_is_401(base_url):
    for headers in (
        {},
        {"authorization": "Bearer sk-llm-wrong"},
        {"api-key": "sk-llm-wrong"},
        {"authorization": "Basic x"},
    ):
        response = httpx.post(base_url + "/v1/chat/completions", json=chat_body(), headers=headers)
        assert response.status_code == 401, (headers, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        sdk(base_url, "sk-llm-wrong").chat.completions.create(**chat_body())


def test_azure_style_api_key_header_authenticates(base_url, redis_server):
    _, secret = create_key(redis_server.url, "azure-style")
    assert post_chat(base_url, secret, chat_body(), header="api-key").status_code == 200


def test_a_model_not_allowed_is_answered_as_one_that_does_not_exist_and_hidden_from_models(base_url, redis_server):
    """A restricted key cannot tell a model it may not use from one that does not exist:
    the same 404, byte for byte but the name it sent, on inference and on the model's card."""
    _, secret = create_key(redis_server.url, "other-models-only", models=["some-other-model"])
    client = sdk(base_url, secret)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(**chat_body())
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(**{**chat_body(), "model": "no-such-model"})
    assert caught.value.body == {
        **missing.value.body,
        "message": missing.value.body["message"].replace("no-such-model", MODEL),
    }
    headers = {"authorization": f"Bearer {secret}"}
    cards = [
        httpx.get(f"{base_url}/v1/models/{name}", headers=headers, timeout=30) for name in (MODEL, "no-such-model")
    ]
    assert [card.status_code for card in cards] == [404, 404]
    assert cards[0].text == cards[1].text.replace("no-such-model", MODEL)
    assert client.models.list().data == []


def test_revoked_key_stops_within_the_cache_ttl(base_url, redis_server):
    _, secret = create_key(redis_server.url, "to-revoke")
    assert post_chat(base_url, secret, chat_body()).status_code == 200
    revoke = httpx.delete(base_url + "/admin/keys/to-revoke", headers={"authorization": f"Bearer {ADMIN}"})
    assert revoke.status_code == 200 and revoke.json()["enabled"] is False
    revoked_at = time.monotonic()
    while post_chat(base_url, secret, chat_body()).status_code != 401:
        assert time.monotonic() - revoked_at < CACHE_TTL_S + 1.0, "revoked key still works"
        time.sleep(0.1)


# -- admin API -------------------------------------------------------------------


def test_admin_api_manages_keys_behind_its_token(base_url):
    admin = httpx.Client(base_url=base_url + "/admin", headers={"authorization": f"Bearer {ADMIN}"})
    assert httpx.get(base_url + "/admin/keys").status_code == 401
    assert httpx.get(base_url + "/admin/keys", headers={"authorization": "Bearer nope"}).status_code == 401

    created = admin.post("/keys", json={"name": "via-admin", "requests_per_minute": 100})
    assert created.status_code == 201, created.text
    secret = created.json()["secret"]
    assert admin.post("/keys", json={"name": "via-admin"}).status_code == 409
    assert admin.post("/keys", json={"name": "bad", "requests_per_minute": -1}).status_code == 400

    updated = admin.patch("/keys/via-admin", json={"tokens_per_minute": 5000})
    assert updated.json()["tokens_per_minute"] == 5000 and updated.json()["requests_per_minute"] == 100
    assert "via-admin" in [k["name"] for k in admin.get("/keys").json()["data"]]
    assert "secret" not in admin.get("/keys/via-admin").json()
    assert admin.get("/keys/nobody").status_code == 404

    completion = sdk(base_url, secret).chat.completions.create(**chat_body())
    _wait_for_status(base_url, completion.id, "completed")  # settlement is off the response path
    usage = admin.get("/keys/via-admin/usage").json()
    assert usage["today"]["requests"] == 1
    assert usage["today"]["completion_tokens"] == completion.usage.completion_tokens


# -- headers and request state -----------------------------------------------------


def test_success_has_rate_headers_request_id_and_a_completed_record(base_url, redis_server):
    _, secret = create_key(redis_server.url, "headers", requests_per_minute=1000, tokens_per_minute=100_000)
    response = post_chat(base_url, secret, chat_body(max_tokens=5))
    assert response.status_code == 200
    headers, body = response.headers, response.json()
    assert headers["x-ratelimit-limit-requests"] == "1000"
    assert int(headers["x-ratelimit-remaining-requests"]) == 999
    assert headers["x-ratelimit-limit-tokens"] == "100000"
    assert headers["x-ratelimit-reset-requests"].endswith("ms") or headers["x-ratelimit-reset-requests"].endswith("s")
    openai_spec.validate(body, "CreateChatCompletionResponse")

    state = _wait_for_status(base_url, body["id"], "completed")
    assert _request_state(base_url, headers["x-request-id"]) == state  # found by either id
    assert state["model"] == MODEL
    assert state["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert state["completion_tokens"] == body["usage"]["completion_tokens"]
    assert state["replica"]
    assert state["received_ms"] <= state["finished_ms"]


def test_stream_record_has_first_token_time_and_real_usage(base_url, redis_server):
    _, secret = create_key(redis_server.url, "stream-record")
    request = chat_body(max_tokens=6, stream=True)
    with httpx.stream(
        "POST",
        base_url + "/v1/chat/completions",
        json=request,
        headers={"authorization": f"Bearer {secret}"},
        timeout=60,
    ) as response:
        request_id = response.headers["x-request-id"]
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" not in c for c in chunks), "usage shown to a client that did not ask"
    assert len({c["id"] for c in chunks}) == 1
    state = _wait_for_status(base_url, request_id, "completed")
    assert state["id"] == chunks[0]["id"].removeprefix("chatcmpl-")
    assert state["received_ms"] <= state["first_token_ms"] <= state["finished_ms"]
    assert state["completion_tokens"] == 6


def _request_state(base_url, request_id):
    response = httpx.get(f"{base_url}/admin/requests/{request_id}", headers={"authorization": f"Bearer {ADMIN}"})
    assert response.status_code == 200, response.text
    return response.json()


def _wait_for_status(base_url, request_id, status, timeout_s=5):
    deadline = time.monotonic() + timeout_s
    while True:
        state = _request_state(base_url, request_id)
        if state["status"] == status or time.monotonic() > deadline:
            assert state["status"] == status, state
            return state
        time.sleep(0.05)


def test_llmctl_reads_the_same_records(base_url, redis_server, capsys):
    from serve_app.cli import main

    _, secret = create_key(redis_server.url, "cli-view")
    completion = sdk(base_url, secret).chat.completions.create(**chat_body())
    _wait_for_status(base_url, completion.id, "completed")
    assert main(["--redis-url", redis_server.url, "requests", "show", completion.id]) == 0
    state = json.loads(capsys.readouterr().out)
    assert state["status"] == "completed" and state["total_tokens"] == completion.usage.total_tokens
    assert main(["--redis-url", redis_server.url, "usage", "--key", "cli-view"]) == 0
    assert json.loads(capsys.readouterr().out)["today"]["tokens"] == completion.usage.total_tokens


# -- limits ------------------------------------------------------------------------


def test_requests_per_minute_hold_across_two_ingress_replicas(base_url, redis_server):
    limit, clients, duration_s = 60, 16, 20.0
    _, secret = create_key(redis_server.url, "hammered", requests_per_minute=limit)
    outcomes: list[tuple[int, dict, dict]] = []
    lock = threading.Lock()
    start = time.monotonic()

    def client_loop():
        with httpx.Client(timeout=60, headers={"authorization": f"Bearer {secret}"}) as http:
            while time.monotonic() - start < duration_s:
                response = http.post(base_url + "/v1/chat/completions", json=chat_body(max_tokens=1))
                body = response.json()
                with lock:
                    outcomes.append((response.status_code, dict(response.headers), body))

    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client_loop) for _ in range(clients)]:
            future.result()
    elapsed = time.monotonic() - start

    admitted = sum(1 for status, _, _ in outcomes if status == 200)
    refused = [(h, b) for status, h, b in outcomes if status == 429]
    assert admitted + len(refused) == len(outcomes), {s for s, _, _ in outcomes}
    allowance = limit + limit * elapsed / 60  # GCRA: the burst, then limit/60 per second
    assert admitted <= math.floor(allowance) + 1, (admitted, allowance)
    assert admitted >= 0.95 * (limit + limit * duration_s / 60), (admitted, allowance)
    for headers, body in refused:
        assert body["error"]["type"] == "requests" and body["error"]["code"] == "rate_limit_exceeded"
        assert headers["x-ratelimit-limit-requests"] == str(limit)
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert 0 < int(headers["retry-after-ms"]) <= 1000 and headers["retry-after"] == "1"


def test_token_reservations_never_overshoot_and_charges_match_reported_usage(base_url, redis_server, redis):
    tpm, max_tokens, parallel = 2000, 200, 16
    key_id, secret = create_key(redis_server.url, "tokens", tokens_per_minute=tpm)
    body = json.dumps(chat_body(max_tokens=max_tokens, ignore_eos=True)).encode()
    reserve = math.ceil(len(body) / 4) + max_tokens  # the ingress's documented estimate

    def one(_):
        return httpx.post(
            base_url + "/v1/chat/completions",
            content=body,
            timeout=120,
            headers={"authorization": f"Bearer {secret}", "content-type": "application/json"},
        )

    start = time.monotonic()
    with ThreadPoolExecutor(parallel) as pool:
        responses = list(pool.map(one, range(parallel)))
    elapsed = time.monotonic() - start
    admitted = [r for r in responses if r.status_code == 200]
    for refused in (r for r in responses if r.status_code != 200):
        assert_429(refused, "tokens")
    reported = sum(r.json()["usage"]["total_tokens"] for r in admitted)
    # Admission counts reservations, not finished usage, so concurrent requests
    # cannot overshoot: at most the burst, what refilled meanwhile, and what
    # finished requests gave back. (Check-then-charge would admit all of them.)
    refunds = len(admitted) * reserve - reported
    assert 1 <= len(admitted) < parallel
    assert len(admitted) * reserve <= tpm + tpm * elapsed / 60 + refunds, (len(admitted), reserve, elapsed)
    today = time.strftime("%Y%m%d", time.gmtime())
    deadline = time.monotonic() + 5
    while int(redis.hget(redis_names.usage(key_id), f"d:{today}:tokens") or 0) != reported:
        assert time.monotonic() < deadline, (redis.hget(redis_names.usage(key_id), f"d:{today}:tokens"), reported)
        time.sleep(0.05)
    assert_within_reservations(wait_until_settled(redis, key_id))  # each request, not only their sum


def test_request_larger_than_the_token_limit(base_url, redis_server):
    _, secret = create_key(redis_server.url, "tiny-tpm", tokens_per_minute=100)
    response = post_chat(base_url, secret, chat_body(max_tokens=500))
    error = assert_429(response, "tokens")
    assert "too large" in error["message"].lower()
    assert "retry-after" not in response.headers


def test_concurrency_limit_holds_and_cancelled_streams_free_their_slots(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "two-at-a-time", max_concurrent=2)
    headers = {"authorization": f"Bearer {secret}"}
    leases = redis_names.concurrency(key_id)
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], redis.zcard(leases))
            time.sleep(0.005)

    def stream(_):
        with httpx.stream(
            "POST",
            base_url + "/v1/chat/completions",
            headers=headers,
            timeout=120,
            json=chat_body(max_tokens=150, ignore_eos=True, stream=True),
        ) as response:
            if response.status_code != 200:
                response.read()
                return response.status_code, response.json()
            return 200, sum(1 for _ in response.iter_lines())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(10) as pool:
            results = list(pool.map(stream, range(10)))
    finally:
        stop.set()
        watcher.join()
    assert peak[0] <= 2
    assert sum(1 for status, _ in results if status == 200) >= 2
    refused = [body for status, body in results if status == 429]
    assert refused and all(b["error"]["type"] == "concurrency" for b in refused)

    # Two streams hold both slots; cancelling them frees the slots at once.
    client = httpx.Client(base_url=base_url, headers=headers, timeout=120)
    open_streams = []
    for _ in range(2):
        cm = client.stream(
            "POST", "/v1/chat/completions", json=chat_body(max_tokens=1500, ignore_eos=True, stream=True)
        )
        response = cm.__enter__()
        assert response.status_code == 200
        lines = response.iter_lines()  # keep it: dropping the iterator closes the connection
        next(lines)
        open_streams.append((cm, lines))
    assert post_chat(base_url, secret, chat_body()).status_code == 429
    for cm, _ in open_streams:
        cm.__exit__(None, None, None)
    client.close()
    deadline = time.monotonic() + 2
    while redis.zcard(leases):
        assert time.monotonic() < deadline, "cancelled streams still hold their slots"
        time.sleep(0.02)
    assert post_chat(base_url, secret, chat_body()).status_code == 200


def test_sdk_retry_on_429_succeeds_by_honouring_retry_after(base_url, redis_server):
    _, secret = create_key(redis_server.url, "six-per-minute", requests_per_minute=6)
    patient = sdk(base_url, secret, max_retries=3)
    for _ in range(6):
        patient.chat.completions.create(**chat_body(max_tokens=1))
    start = time.monotonic()
    completion = patient.chat.completions.create(**chat_body(max_tokens=1))  # refused once, retried after ~10 s
    waited = time.monotonic() - start
    assert completion.choices
    assert 8 < waited < 20, waited


def test_exhausted_daily_budget_is_insufficient_quota(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "small-budget", daily_token_budget=300)
    client = sdk(base_url, secret)
    client.chat.completions.create(**chat_body(max_tokens=4))
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(**chat_body(max_tokens=250))
    assert caught.value.code == "insufficient_quota"
    assert caught.value.body["type"] == "daily_token_budget"
    found = wait_until_settled(redis, key_id)
    assert len(found) == 1  # the refused request left no record
    assert_within_reservations(found)


# -- Redis outage (last: stops and restarts Redis) ----------------------------------
# fail_mode closed: tests/integration/test_quota_hardening.py (no redeploy, no engine restart)


def test_fail_open_keeps_serving_and_uses_redis_again_when_it_returns(base_url, redis_server):
    _, secret = create_key(redis_server.url, "outage-open", requests_per_minute=1000)
    for _ in range(12):  # both ingress replicas get to know (and cache) the key
        assert post_chat(base_url, secret, chat_body(max_tokens=1)).status_code == 200
    redis_server.stop()
    try:
        response = post_chat(base_url, secret, chat_body())
        assert response.status_code == 200, response.text
    finally:
        redis_server.start()
    deadline = time.monotonic() + 10
    while True:
        response = post_chat(base_url, secret, chat_body())
        assert response.status_code == 200
        request = httpx.get(
            f"{base_url}/admin/requests/{response.json()['id']}", headers={"authorization": f"Bearer {ADMIN}"}
        )
        if request.status_code == 200:  # admitted through Redis again: it has a record
            break
        assert time.monotonic() < deadline, "the gateway did not go back to Redis"
        time.sleep(0.2)
