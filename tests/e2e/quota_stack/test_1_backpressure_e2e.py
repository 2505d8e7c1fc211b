"""Backpressure: a model whose replicas are busy and whose queue is full is
answered 503 at once (OpenAI envelope, retry-after), never 429, and a refused
request costs the key nothing and holds no concurrency slot. Also model aliases.

The package's stack (stack_args.py) has a narrow copy of the demo chat model for
this (alias "chat-narrow"): one request at a time per replica and a queue of
one, so a handful of concurrent requests fill it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis as redis_sync

from http_checks import assert_error_envelope
from settled import wait_until_settled
from quota_stack.stack_args import NARROW, NARROW_ALIAS
from stack import create_key

pytestmark = pytest.mark.e2e

MODEL, ALIAS = NARROW, NARROW_ALIAS
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "min_tokens": 300,
        "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def key(base_url, redis_server):
    return create_key(redis_server.url, "backpressure", requests_per_minute=10_000, max_concurrent=50)


def _post(base_url, secret, stream):
    body = {**LONG, "stream": stream}
    with httpx.Client(base_url=base_url, timeout=120, headers={"authorization": f"Bearer {secret}"}) as client:
        if not stream:
            return client.post("/v1/chat/completions", json=body)
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.read()  # the whole stream: the slot is held until it ends
            return response


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_full_queue_is_503_with_retry_after_never_429(base_url, redis_server, key, stream):
    key_id, secret = key
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: _post(base_url, secret, stream), range(6)))
    statuses = sorted(response.status_code for response in responses)
    assert 200 in statuses and 503 in statuses and 429 not in statuses, statuses
    assert set(statuses) <= {200, 503}, statuses
    for response in responses:
        if response.status_code != 503:
            continue
        error = assert_error_envelope(response, 503)
        assert error["code"] == "model_overloaded" and error["type"] == "service_unavailable_error"
        assert int(response.headers["retry-after"]) >= 1 and int(response.headers["retry-after-ms"]) >= 1000

    # Refused requests hold no slot and are recorded as overloaded.
    redis = redis_sync.Redis.from_url(redis_server.url)
    wait_until_settled(redis, key_id)
    refused = [r for r in responses if r.status_code == 503]
    request_id = refused[0].headers["x-request-id"]
    record = _record(redis_server.url, request_id)
    assert record["status"] == "overloaded" and int(record.get("completion_tokens", 0)) == 0


def _record(redis_url, http_request_id):
    import asyncio

    import redis.asyncio

    from serve_app.usage import request_state

    async def fetch():
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            deadline = time.monotonic() + 5
            while True:
                state = await request_state(client, http_request_id)
                if (state and state.get("status") != "admitted") or time.monotonic() > deadline:
                    return state
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()

    return asyncio.run(fetch())


def test_served_again_once_the_queue_drains(base_url, key):
    response = _post(base_url, key[1], stream=False)
    assert response.status_code == 200, response.text


def test_an_alias_routes_to_its_model_and_is_listed(base_url, redis_server):
    _, secret = create_key(redis_server.url, "alias-user", models=[MODEL])
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=60)
    reply = client.chat.completions.create(model=ALIAS, messages=LONG["messages"], max_tokens=3)
    assert reply.model == MODEL and reply.usage.completion_tokens <= 3
    cards = {card.id: card for card in client.models.list().data}
    assert list(cards) == [MODEL, ALIAS]
    assert cards[ALIAS].model_extra["alias_of"] == MODEL
    assert client.models.retrieve(ALIAS).model_extra["alias_of"] == MODEL
