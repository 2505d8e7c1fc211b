"""vLLM's tokenizer endpoints (/tokenize, /detokenize) through the gateway, with
plain HTTP as vLLM documents them: a key, the key's model list, a request
counted against its quota, never a token of its budget."""

from __future__ import annotations

import httpx
import pytest
from http_checks import assert_error_envelope
from settled import wait_until_settled
from stack import create_key

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
EMBEDDING_MODEL = "minilm"


def test_tokenize_then_detokenize_gives_the_text_back(http):
    tokenized = http.post("/tokenize", json={"model": MODEL, "prompt": "The license is short."})
    assert tokenized.status_code == 200, tokenized.text
    answer = tokenized.json()
    assert answer["count"] == len(answer["tokens"]) > 0 and answer["max_model_len"] == 2048
    detokenized = http.post("/detokenize", json={"model": MODEL, "tokens": answer["tokens"]})
    assert detokenized.status_code == 200, detokenized.text
    assert detokenized.json()["prompt"].endswith("The license is short.")  # after the BOS token, if any


def test_tokenized_messages_are_what_chat_charges_as_the_prompt(http):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a license?"}]
    tokenized = http.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert tokenized.status_code == 200, tokenized.text
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1})
    assert tokenized.json()["count"] == chat.json()["usage"]["prompt_tokens"]


def test_the_embedding_model_tokenizes_too(http):
    tokenized = http.post("/tokenize", json={"model": EMBEDDING_MODEL, "prompt": "a red car"})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["count"] > 0


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"model": MODEL}, None),  # neither prompt nor messages
        ("/tokenize", {"model": MODEL, "prompt": "a", "messages": [{"role": "user", "content": "a"}]}, None),
        ("/tokenize", {"model": MODEL, "prompt": ["a"]}, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": "a", "no_such_field": 1}, "no_such_field"),
        ("/tokenize", {"prompt": "a"}, "model"),
        ("/detokenize", {"model": MODEL, "tokens": ["1"]}, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": [-1]}, None),  # vLLM's own bound
        ("/detokenize", {"model": MODEL, "tokens": [2**70]}, None),
    ],
)
def test_bad_tokenizer_requests_are_a_400_naming_the_problem(http, path, body, param):
    error = assert_error_envelope(http.post(path, json=body), 400)
    if param is not None:
        assert error["param"] == param, error


def test_tokenizer_requests_count_as_requests_and_charge_no_tokens(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "tokenizer-quota", requests_per_minute=2)
    with httpx.Client(base_url=base_url, timeout=60, headers={"authorization": f"Bearer {secret}"}) as http:
        statuses = [http.post("/tokenize", json={"model": MODEL, "prompt": "x " * 500}).status_code for _ in range(3)]
        assert statuses == [200, 200, 429]
        assert http.post("/detokenize", json={"model": MODEL, "tokens": [1]}).status_code == 429
    found = wait_until_settled(redis, key_id)
    assert len(found) == 2 and all(r["status"] == "completed" for r in found), found
    assert {(r["prompt_tokens"], r["completion_tokens"]) for r in found} == {("0", "0")}
