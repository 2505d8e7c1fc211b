"""Anthropic's Messages API (``POST /v1/messages``) with Anthropic's own SDK as
the client: unary, streamed, a tool call, the key in ``x-api-key``, errors in
Anthropic's shape. What a message says is checked against the same
conversation through the OpenAI route (greedy: the same tokens), and what the
key is charged against what the message reports."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from settled import wait_until_settled
from stack import create_key

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
QUESTION = [{"role": "user", "content": "What is a mixture of experts model?"}]
SYSTEM = "Answer in one sentence."
# Anthropic's SDK (2.x) has no sampling arguments of its own any more; the API takes them.
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    # An enum keeps the random-weights model's argument short: a call cut by max_tokens is
    # unparseable JSON, which vLLM's Anthropic layer answers with a 400.
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def claude(base_url: str, secret: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=secret, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def openai_answer(client):
    """The same conversation through the OpenAI route."""
    messages = [{"role": "system", "content": SYSTEM}, *QUESTION]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)


def test_a_message_is_the_chat_answer_in_anthropics_shape_and_charged_its_usage(
    base_url, redis_server, redis, openai_answer
):
    key_id, secret = create_key(redis_server.url, "anthropic-unary")
    message = claude(base_url, secret).messages.create(
        model=MODEL, system=SYSTEM, messages=QUESTION, max_tokens=10, extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    [block] = message.content
    assert block.type == "text" and block.text == openai_answer.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[openai_answer.choices[0].finish_reason]
    assert message.usage.input_tokens == openai_answer.usage.prompt_tokens
    assert message.usage.output_tokens == openai_answer.usage.completion_tokens
    [record] = wait_until_settled(redis, key_id)
    assert record["status"] == "completed"
    assert (int(record["prompt_tokens"]), int(record["completion_tokens"])) == (
        message.usage.input_tokens,
        message.usage.output_tokens,
    )


def test_a_streamed_message_has_anthropics_events_and_is_charged_its_usage(
    base_url, redis_server, redis, openai_answer
):
    key_id, secret = create_key(redis_server.url, "anthropic-stream")
    with claude(base_url, secret).messages.stream(
        model=MODEL, system=SYSTEM, messages=QUESTION, max_tokens=10, extra_body=GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert "content_block_delta" in kinds
    assert message.content[0].text == openai_answer.choices[0].message.content
    assert message.usage.output_tokens == openai_answer.usage.completion_tokens
    [record] = wait_until_settled(redis, key_id)
    assert record["status"] == "completed"
    assert (int(record["prompt_tokens"]), int(record["completion_tokens"])) == (
        openai_answer.usage.prompt_tokens,
        openai_answer.usage.completion_tokens,
    )


def test_count_tokens_is_what_a_message_is_charged_as_input_and_charges_nothing(
    base_url, redis_server, redis, openai_answer
):
    key_id, secret = create_key(redis_server.url, "anthropic-count")
    counted = claude(base_url, secret).messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION)
    assert counted.input_tokens == openai_answer.usage.prompt_tokens
    [record] = wait_until_settled(redis, key_id)
    assert (record["status"], record["prompt_tokens"], record["completion_tokens"]) == ("completed", "0", "0")


def test_a_forced_tool_call_is_a_tool_use_block_with_input_that_fits_the_schema(base_url, api_key):
    message = claude(base_url, api_key).messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        max_tokens=100,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    tool_uses = [block for block in message.content if block.type == "tool_use"]
    assert tool_uses and tool_uses[0].name == "get_weather", message
    assert tool_uses[0].input in ({"city": "Oslo"}, {"city": "Lima"}) and tool_uses[0].id
    assert message.stop_reason == "tool_use"


def test_errors_are_anthropics_shape_and_statuses(base_url, api_key, redis_server):
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude(base_url, api_key).messages.create(model="no-such-model", messages=QUESTION, max_tokens=4)
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as unknown:
        claude(base_url, "sk-not-a-key").messages.create(model=MODEL, messages=QUESTION, max_tokens=4)
    assert unknown.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude(base_url, api_key).messages.create(model=MODEL, messages=QUESTION, max_tokens=-1)
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in bad.value.message
    _, limited = create_key(redis_server.url, "anthropic-limited", requests_per_minute=1)
    claude(base_url, limited).messages.create(model=MODEL, messages=QUESTION, max_tokens=1)
    with pytest.raises(anthropic.RateLimitError) as refused:
        claude(base_url, limited).messages.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    assert int(refused.value.response.headers["retry-after"]) >= 1


def test_a_request_anthropic_would_refuse_is_a_400_in_its_shape(base_url, api_key):
    for body in (
        {"model": MODEL, "messages": QUESTION},  # no max_tokens
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
        {"model": MODEL, "max_tokens": 4, "messages": QUESTION, "no_such_field": 1},
    ):
        response = httpx.post(base_url + "/v1/messages", json=body, headers={"x-api-key": api_key}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error


def test_a_stream_the_client_abandons_leaves_no_slot_and_no_record_running(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "anthropic-abandon", max_concurrent=1)
    body = {"model": MODEL, "max_tokens": 1500, "messages": QUESTION, "stream": True, "temperature": 1.0}
    with httpx.Client(base_url=base_url, timeout=60, headers={"x-api-key": secret}) as http:
        with http.stream("POST", "/v1/messages", json=body) as response:
            assert response.status_code == 200
            assert next(response.iter_lines()).startswith("event: message_start")
        # hung up after the first event; the one concurrency slot comes back
        [record] = wait_until_settled(redis, key_id)
        assert record["status"] in ("cancelled", "completed"), record  # completed: it fit the socket buffers
        again = http.post("/v1/messages", json={**body, "stream": False, "max_tokens": 2})
        assert again.status_code == 200, again.text
