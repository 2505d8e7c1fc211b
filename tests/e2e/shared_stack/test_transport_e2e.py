"""Nothing between ingress and replica fails on size (Ray Serve's replica gRPC
refuses 4 MiB by default; serve_app/app.py TRANSPORT_ENV): bodies up to the
request body limit reach the replica on every route, unary and streamed; answers
far larger than 4 MiB come back; a stored conversation larger than 4 MiB
continues. A key is charged what its requests used, never a reservation sized by
the body's bytes."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from settled import wait_until_settled
from stack import create_key

from serve_app.redis_store import redis_names

pytestmark = pytest.mark.e2e

BODY_LIMIT = 8 * 1024 * 1024  # configs/local.yaml's ingress.max_body_bytes
PAD = "x" * (5 * 1024 * 1024)  # past Serve's default gRPC message, within the body limit
CHAT = "tiny-llama"
HI = [{"role": "user", "content": "hi"}]

# A 5 MiB field each route carries to the replica without tokenizing it.
PADDED = [
    ("/v1/chat/completions", {"model": CHAT, "messages": HI, "max_tokens": 2, "user": PAD}),
    ("/v1/chat/completions", {"model": CHAT, "messages": HI, "max_tokens": 2, "user": PAD, "stream": True}),
    ("/v1/completions", {"model": CHAT, "prompt": "hi", "max_tokens": 2, "user": PAD}),
    ("/v1/embeddings", {"model": "minilm", "input": "hi", "user": PAD}),
    ("/v1/messages", {"model": CHAT, "messages": HI, "max_tokens": 2, "metadata": {"user_id": PAD}}),
    ("/v1/messages", {"model": CHAT, "messages": HI, "max_tokens": 2, "metadata": {"user_id": PAD}, "stream": True}),
    ("/v1/responses", {"model": CHAT, "input": "hi", "max_output_tokens": 2, "user": PAD}),
    ("/v1/responses", {"model": CHAT, "input": "hi", "max_output_tokens": 2, "user": PAD, "stream": True}),
]


def new_key(redis_server, name: str) -> tuple[str, dict[str, str]]:
    key_id, secret = create_key(redis_server.url, f"{name}-{uuid.uuid4().hex[:8]}")
    return key_id, {"authorization": f"Bearer {secret}"}


def charged(redis, key_id: str, requests: int) -> dict[str, int]:
    """Today's counters of ``key_id`` once its ``requests`` are settled."""
    wait_until_settled(redis, key_id, records_expected=requests)
    usage = {k.decode(): int(v) for k, v in redis.hgetall(redis_names.usage(key_id)).items()}
    # The key's own day counters, d:<day>:<name> (not the usage API's per-model ones, d:<day>:model:<m>:<name>).
    return {
        name: sum(v for k, v in usage.items() if k.startswith("d:") and k.count(":") == 2 and k.endswith(":" + name))
        for name in ("requests", "tokens", "prompt_tokens", "completion_tokens")
    }


@pytest.mark.parametrize("path, body", PADDED, ids=[f"{p}{'-stream' if b.get('stream') else ''}" for p, b in PADDED])
def test_a_body_past_4_mib_reaches_the_replica_and_is_charged_what_it_used(base_url, redis_server, redis, path, body):
    key_id, headers = new_key(redis_server, "transport-" + path.strip("/").replace("/", "-"))
    response = httpx.post(base_url + path, json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text[:300]
    if body.get("stream"):
        assert "error" not in response.text.split("data: ")[-2]  # the last event before the end is not an error
    got = charged(redis, key_id, 1)
    # What the prompt ("hi" in a template) and two tokens cost: never a reservation
    # sized by the body's 5 MiB (~1.3 million tokens).
    assert got["requests"] == 1 and got["tokens"] == got["prompt_tokens"] + got["completion_tokens"] < 200, got
    assert got["completion_tokens"] <= 2 or path == "/v1/embeddings"


def test_a_body_at_the_limit_is_served_and_one_byte_more_is_a_413_charged_no_token(base_url, redis_server, redis):
    """One byte past the body limit is a 413; as a large body refused for the client's
    mistake it counts as a request of its key (docs/quotas.md, "Work before admission")
    and is charged no token."""
    key_id, headers = new_key(redis_server, "transport-limit")
    base = {"model": CHAT, "messages": HI, "max_tokens": 2, "user": ""}
    room = BODY_LIMIT - len(json.dumps(base, separators=(",", ":")))
    statuses, answers = [], []
    for extra in (0, 1):
        raw = json.dumps({**base, "user": "x" * (room + extra)}, separators=(",", ":")).encode()
        assert len(raw) == BODY_LIMIT + extra
        response = httpx.post(
            base_url + "/v1/chat/completions",
            content=raw,
            timeout=120,
            headers={**headers, "content-type": "application/json"},
        )
        statuses.append(response.status_code)
        answers.append(response.json())
    assert statuses == [200, 413]
    counted = charged(redis, key_id, 2)
    assert counted["requests"] == 2 and counted["tokens"] == answers[0]["usage"]["total_tokens"]


def test_an_answer_far_past_4_mib_comes_back_and_one_input_too_many_is_a_400(base_url, redis_server, redis):
    key_id, headers = new_key(redis_server, "transport-answer")
    response = httpx.post(
        base_url + "/v1/embeddings", json={"model": "minilm", "input": ["hi"] * 2048}, headers=headers, timeout=300
    )
    assert response.status_code == 200 and len(response.content) > 12 * 1024 * 1024
    assert len(response.json()["data"]) == 2048
    refused = httpx.post(
        base_url + "/v1/embeddings", json={"model": "minilm", "input": ["hi"] * 2049}, headers=headers, timeout=60
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"
    assert "2048" in refused.json()["error"]["message"]
    assert charged(redis, key_id, 1)["requests"] == 1


def test_a_stored_conversation_past_4_mib_continues(base_url, redis_server, redis):
    key_id, headers = new_key(redis_server, "transport-conversation")
    first = httpx.post(
        base_url + "/v1/responses",
        headers=headers,
        timeout=120,
        json={
            "model": CHAT,
            "max_output_tokens": 2,
            "input": [{"type": "message", "role": "user", "content": "hi", "note": PAD}],
        },
    )
    assert first.status_code == 200, first.text[:300]
    follow_up = httpx.post(
        base_url + "/v1/responses",
        headers=headers,
        timeout=120,
        json={"model": CHAT, "max_output_tokens": 2, "input": "more", "previous_response_id": first.json()["id"]},
    )
    assert follow_up.status_code == 200, follow_up.text[:300]
    got = charged(redis, key_id, 2)
    assert got["tokens"] == got["prompt_tokens"] + got["completion_tokens"] < 400, got
