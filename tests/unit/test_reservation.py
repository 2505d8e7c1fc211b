"""The reservation is an upper bound of what the engine may generate."""

import json

import pytest

from serve_app.errors import OpenAIError
from serve_app.wire.reservation import MAX_TOKENS_LIMIT, reserve


def chat(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def tokens(operation, body, context=2048, default=1024, raw=400):
    return reserve(operation, body, raw, default_max_tokens=default, context_length=context)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", "1000"),
        ("max_tokens", 1000.0),
        ("max_tokens", True),
        ("max_tokens", [5]),
        ("max_completion_tokens", "5"),
        ("n", "4"),
        ("n", 2.0),
        ("max_tokens", 10**30),
        ("max_tokens", -1),
        ("max_completion_tokens", 0),
        ("n", 0),
        ("n", 129),
    ],
)
def test_generation_sizes_must_be_integers_in_range(field, value):
    with pytest.raises(OpenAIError) as caught:
        tokens("chat", chat(**{field: value}))
    assert caught.value.status == 400 and caught.value.param == field
    assert field in caught.value.message


def test_n_and_every_prompt_multiply_the_completion_budget():
    body = {"model": "m", "prompt": ["a"] * 8, "max_tokens": 500, "n": 2}
    r = tokens("completions", body, raw=100)
    assert r.choices == 16 and r.completion_per_choice == 500 and r.tokens == 25 + 16 * 500
    token_lists = {"model": "m", "prompt": [[1, 2, 3]] * 4, "max_tokens": 10}
    assert tokens("completions", token_lists).choices == 4
    assert tokens("completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 10}).choices == 1


def test_token_id_prompts_are_counted_exactly():
    body = {"model": "m", "prompt": [0] * 4000, "max_tokens": 1}
    assert tokens("completions", body, raw=8000).prompt == 4000  # 2 bytes per id: the estimate would say 2000


def test_a_request_without_max_tokens_gets_one_named_for_it():
    """Named for the client, never written into its body: the gateway sets it on the
    call (serve_app/pipeline/replica_request.py)."""
    body = chat()
    r = tokens("chat", body, default=1024, context=512)
    assert r.named_for_client == ("max_tokens", 512) and r.completion_per_choice == 512  # never beyond the context
    assert "max_tokens" not in body
    many = tokens("chat", chat(n=3), default=1024)
    assert many.tokens == 100 + 3 * 1024 and many.named_for_client == ("max_tokens", 1024)
    assert tokens("completions", {"model": "m", "prompt": "x"}).named_for_client == ("max_tokens", 16)  # OpenAI's
    assert tokens("chat", chat(max_tokens=10)).named_for_client is None  # the client's own stands


def test_the_larger_of_both_max_fields_and_the_context_bound_the_reservation():
    assert tokens("chat", chat(max_tokens=10, max_completion_tokens=300)).completion_per_choice == 300
    assert tokens("chat", chat(max_tokens=MAX_TOKENS_LIMIT), context=2048).completion_per_choice == 2048
    assert tokens("chat", chat(max_tokens=MAX_TOKENS_LIMIT), context=None).completion_per_choice == MAX_TOKENS_LIMIT


def test_embeddings_reserve_the_prompt_only():
    r = tokens("embeddings", {"model": "e", "input": "hello"}, raw=40)
    assert r.tokens == 10


@pytest.mark.parametrize(
    "operation, body",
    [
        ("tokenize", {"model": "m", "prompt": "x" * 4000, "max_tokens": 10**6}),
        ("detokenize", {"model": "m", "tokens": list(range(1000))}),
    ],
)
def test_the_tokenizer_endpoints_reserve_no_tokens_and_leave_the_body_alone(operation, body):
    sent = dict(body)
    assert tokens(operation, body, raw=len(json.dumps(body))).tokens == 0
    assert body == sent


@pytest.mark.parametrize("operation", ["score", "rerank"])
def test_scoring_reserves_its_texts_as_prompt_tokens_and_nothing_generated(operation):
    body = {"model": "e", "query": "q", "documents": ["d"] * 10, "max_tokens": 10**6}
    r = tokens(operation, body, raw=400)
    assert (r.prompt, r.completion_per_choice, r.tokens) == (100, 0, 100) and "max_tokens" in body


def test_responses_reserve_max_output_tokens_and_the_input_as_sent_to_the_engine():
    history = [{"type": "message", "role": "user", "content": "x" * 4000}]  # a stored conversation
    body = {"model": "m", "input": history, "max_output_tokens": 50}
    r = tokens("responses", body, raw=100)
    assert r.completion_per_choice == 50 and r.prompt >= 1000  # not the 25 the client's body alone suggests
    unnamed = {"model": "m", "input": "hi"}
    named = tokens("responses", unnamed, default=300)
    assert named.completion_per_choice == 300
    assert named.named_for_client == ("max_output_tokens", 300)  # the engine must not pick its own
    with pytest.raises(OpenAIError):
        tokens("responses", {"model": "m", "input": "hi", "max_output_tokens": 0})
