"""Backpressure: a model whose replicas are busy and whose queue is full is
answered 503 at once (OpenAI envelope, retry-after), never 429, and a refused
request costs the key nothing and holds no concurrency slot. Also model aliases.

The package's stack (stack_args.py) has a narrow copy of the demo chat model for
this (alias "chat-narrow"): one request at a time per replica and a queue of
one, so a handful of concurrent requests fill it. A long stream holds the
replica first, so the flood meets a busy model whatever the box's pace (a CI run
saw six unheld 300-token requests arrive spread out enough for all to be served).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis as redis_sync
from http_checks import assert_error_envelope
from settled import wait_until_settled
from stack import create_key

from quota_stack.stack_args import NARROW, NARROW_ALIAS

pytestmark = pytest.mark.e2e

MODEL, ALIAS = NARROW, NARROW_ALIAS
LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 300,
    "min_tokens": 300,
    "ignore_eos": True,
    "temperature": 0,
}


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


HOLD_TOKENS = 1500  # the holder's stream: seconds of decoding on this box (the model's context is 2048)


def _hold(base_url, secret, started: threading.Event) -> tuple[int, str | None]:
    """Stream HOLD_TOKENS tokens, setting ``started`` at the first content chunk
    (the replica's one slot is then taken). Returns (content chunks, finish_reason)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=120)
    chunks, finish = 0, None
    try:
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=LONG["messages"],
            max_tokens=HOLD_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"min_tokens": HOLD_TOKENS, "ignore_eos": True},
        ):
            for choice in chunk.choices:
                if choice.delta.content:
                    chunks += 1
                    started.set()
                finish = choice.finish_reason or finish
        return chunks, finish
    finally:
        started.set()  # never leave the test waiting on a holder that failed


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_full_queue_is_503_with_retry_after_never_429(base_url, redis_server, key, stream):
    key_id, secret = key
    started = threading.Event()
    with ThreadPoolExecutor(7) as pool:
        holder = pool.submit(_hold, base_url, secret, started)
        assert started.wait(60), "the holding stream never started"
        assert not holder.done(), holder.result()  # still holding the replica when the flood comes
        responses = list(pool.map(lambda _: _post(base_url, secret, stream), range(6)))
        held_chunks, held_finish = holder.result()
    assert held_chunks > 0 and held_finish == "length", (held_chunks, held_finish)
    statuses = sorted(response.status_code for response in responses)
    # The replica's one place is the holder's and each of the two ingress replicas
    # queues one, however many arrive together: the rest are refused, the queued
    # ones served once the holder ends. (Before the gateway looked at its queue again
    # after admission, requests admitted together all queued: four of six here.)
    assert 1 <= statuses.count(200) <= 2 and 429 not in statuses, statuses
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

    from serve_app.accounting.usage import request_state

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
