"""What a body may make the loop parse and validate, on the real stack as `make run`
ships it (chat, completions and embeddings in one hop to the model's replica, whose
loop relays every stream of that replica; Anthropic's Messages and the Responses API
through the ingress): a body that may hold more JSON values than ``MAX_JSON_VALUES``
is a 400 before it is parsed, and a conversation of more messages than the model's
context has tokens a 400 before vLLM's request model validates each of them, each in
the route's own error shape, charged nothing, while another key's chat is answered
(docs/quotas.md, "Work before admission"). Before these bounds an 8 MiB body of
``[]`` took a replica's loop 3.2 s to parse, one of one-letter messages 2.5 s to parse
and validate (bench/body_parse.py)."""

from __future__ import annotations

import json

import httpx
import pytest
from settled import counters
from stack import create_key

from serve_app.wire.api_requests import MAX_JSON_VALUES

pytestmark = pytest.mark.e2e

CHAT_MODEL = "tiny-llama"
CONTEXT = 2048  # the demo chat model's (configs/local.yaml)
EMBEDDING_MODEL = "minilm"
ONE_LETTER = {"role": "user", "content": "a"}
# A message is 3 of the counted characters (its '{', the ',' between its members, the
# ',' after it): these many are past the bound and within the 8 MiB body limit.
DENSE_MESSAGES = MAX_JSON_VALUES // 3 + 25_000

# Each the densest of its kind that the 8 MiB body limit lets through.
DENSE_BODIES = {
    "empty arrays": (
        "/v1/completions",
        b'{"model": "tiny-llama", "prompt": "x", "x": [' + b"[]," * MAX_JSON_VALUES + b"[]]}",
    ),
    "token ids": ("/v1/completions", json.dumps({"model": CHAT_MODEL, "prompt": [7] * (2 * MAX_JSON_VALUES)}).encode()),
    "one-letter messages": (
        "/v1/chat/completions",
        json.dumps({"model": CHAT_MODEL, "messages": [ONE_LETTER] * DENSE_MESSAGES}).encode(),
    ),
    "lists of token ids": (
        "/v1/embeddings",
        json.dumps({"model": EMBEDDING_MODEL, "input": [[7] * 300] * 2048}).encode(),
    ),
    "Anthropic messages": (
        "/v1/messages",
        json.dumps({"model": CHAT_MODEL, "max_tokens": 1, "messages": [ONE_LETTER] * DENSE_MESSAGES}).encode(),
    ),
    "Responses input": (
        "/v1/responses",
        json.dumps({"model": CHAT_MODEL, "input": [ONE_LETTER] * DENSE_MESSAGES}).encode(),
    ),
}


def post(base_url: str, secret: str, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(
        base_url + path,
        content=raw,
        headers={"authorization": f"Bearer {secret}", "content-type": "application/json"},
        timeout=120,
    )


def error_of(response: httpx.Response, path: str) -> dict:
    """The error object in the route's own shape (Anthropic's for its Messages API)."""
    body = response.json()
    if path == "/v1/messages":
        assert body["type"] == "error", body
        return body["error"]
    return body["error"]


def chat_answers(base_url: str, secret: str) -> bool:
    answer = post(
        base_url,
        secret,
        "/v1/chat/completions",
        json.dumps({"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode(),
    )
    return answer.status_code == 200


@pytest.mark.parametrize("shape", list(DENSE_BODIES))
def test_a_body_of_more_values_than_the_bound_is_refused_before_it_is_parsed(base_url, redis, redis_server, shape):
    path, raw = DENSE_BODIES[shape]
    assert len(raw) <= 8 * 2**20  # within the body limit: only its values are too many
    key_id, secret = create_key(redis_server.url, f"dense-body-{shape}")
    _, victim = create_key(redis_server.url, f"dense-body-victim-{shape}")
    response = post(base_url, secret, path, raw)
    assert response.status_code == 400, response.text[:300]
    error = error_of(response, path)
    assert error.get("code", "json_too_large") == "json_too_large" and f"{MAX_JSON_VALUES:,}" in error["message"]
    assert "Traceback" not in response.text
    assert counters(redis, key_id).get("tokens", 0) == 0
    assert chat_answers(base_url, victim)


@pytest.mark.parametrize(
    "path, field, extra",
    [
        ("/v1/chat/completions", "messages", {"max_tokens": 1}),
        ("/v1/messages", "messages", {"max_tokens": 1}),
        ("/v1/responses", "input", {"max_output_tokens": 16}),
        ("/tokenize", "messages", {}),
    ],
)
def test_more_messages_than_the_context_has_tokens_is_refused_before_vllm_validates_them(
    base_url, redis, redis_server, path, field, extra
):
    key_id, secret = create_key(redis_server.url, f"many-messages-{path}")
    raw = json.dumps({"model": CHAT_MODEL, field: [ONE_LETTER] * (CONTEXT + 1), **extra}).encode()
    response = post(base_url, secret, path, raw)
    assert response.status_code == 400, response.text[:300]
    error = error_of(response, path)
    assert f"maximum length {CONTEXT}" in error["message"] and f"length {CONTEXT + 1}" in error["message"]
    if path != "/v1/messages":  # Anthropic's error object has no param or code
        assert (error["param"], error["code"]) == (field, "array_above_max_length")
    assert counters(redis, key_id).get("tokens", 0) == 0
    # As many messages as the context: past the gateway, vLLM's own count decides.
    fits = post(
        base_url, secret, path, json.dumps({"model": CHAT_MODEL, field: [ONE_LETTER] * CONTEXT, **extra}).encode()
    )
    assert fits.status_code in (200, 400), fits.text[:300]
    if fits.status_code == 400:
        assert "array_above_max_length" not in fits.text


# An answer is not stored, but it is built, serialised and sent: its size is bounded by
# its tokens, each of which carries at most vLLM's ``max_logprobs`` (20) alternatives.
MAX_LOGPROBS = 20
# A token's entry in a completions answer with logprobs, alternatives included, as JSON:
# its text (16 characters at most in this vocabulary, each escaped to 6 at most), a float
# and the separators, once and in each of its 20 alternatives.
ENTRY_BYTES = (16 * 6 + 32) * (1 + MAX_LOGPROBS)


@pytest.mark.parametrize(
    "path, fields",
    [
        ("/v1/completions", {"prompt": "hi", "logprobs": MAX_LOGPROBS + 1}),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": MAX_LOGPROBS + 1}),
        ("/v1/chat/completions", {"messages": [ONE_LETTER], "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}),
        ("/v1/chat/completions", {"messages": [ONE_LETTER], "prompt_logprobs": MAX_LOGPROBS + 1}),
        ("/v1/completions", {"prompt": "hi", "logprobs": -1}),  # vLLM's "the whole vocabulary"
    ],
)
def test_more_logprobs_than_the_engine_bound_is_a_400(http, path, fields):
    response = http.post(path, json={"model": CHAT_MODEL, "max_tokens": 1, **fields})
    assert response.status_code == 400, response.text[:300]


def test_an_answer_with_every_logprob_is_bounded_by_its_tokens(http):
    """A dense prompt echoed with 20 logprobs a token, prompt and completion: the answer
    is at most ``ENTRY_BYTES`` a token (what the key is charged for)."""
    dense = '!?\\"\u00e9' * 120  # punctuation, escapes and a non-ASCII letter: long JSON per token
    response = http.post(
        "/v1/completions",
        json={
            "model": CHAT_MODEL,
            "prompt": dense,
            "echo": True,
            "logprobs": MAX_LOGPROBS,
            "prompt_logprobs": MAX_LOGPROBS,
            "max_tokens": 16,
        },
    )
    assert response.status_code == 200, response.text[:300]
    usage = response.json()["usage"]
    tokens = usage["prompt_tokens"] + usage["completion_tokens"]
    per_token = len(response.content) / tokens
    print(f"answer: {len(response.content):,} bytes for {tokens} tokens ({per_token:.0f} bytes a token)")
    assert usage["prompt_tokens"] > 300
    assert len(response.content) <= tokens * ENTRY_BYTES * 2  # echoed: the prompt's tokens come twice
