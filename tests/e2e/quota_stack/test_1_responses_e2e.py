"""OpenAI's Responses API with the official SDK, on the stack with two ingress
replicas: the conversation lives in Redis, so a follow-up through
``previous_response_id`` works on whichever ingress and replica receive it, and
another key never reads a response. What the engine was given is checked by
what it charged: a follow-up's input tokens are the whole conversation's, as
chat counts it."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import openai_spec
import pytest
from settled import wait_until_settled
from stack import create_key

from quota_stack.ingresses import ingress_pid
from quota_stack.stack_args import MODEL

pytestmark = pytest.mark.e2e


def sdk(base_url: str, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=120)


def create(client: openai.OpenAI, **body):
    """(the response, Serve's id of the HTTP request that got it)."""
    raw = client.responses.with_raw_response.create(model=MODEL, temperature=0, **body)
    openai_spec.validate(raw.http_response.json(), "Response")  # the wire format, as sent
    return raw.parse(), raw.headers["x-request-id"]


def test_a_response_is_the_chat_answer_in_the_responses_shape_and_charged_its_usage(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "responses-unary")
    client = sdk(base_url, secret)
    response, _ = create(client, input="Tell me a story.", max_output_tokens=8, store=False)
    assert response.status in ("completed", "incomplete") and response.store is False
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=8, temperature=0
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    records = wait_until_settled(redis, key_id)
    charged = {(int(r["prompt_tokens"]), int(r["completion_tokens"])) for r in records}
    assert (response.usage.input_tokens, response.usage.output_tokens) in charged
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        client.responses.retrieve(response.id)


def test_a_streamed_response_has_the_typed_events_and_is_stored(base_url, redis_server):
    _, secret = create_key(redis_server.url, "responses-stream")
    client = sdk(base_url, secret)
    with client.responses.stream(model=MODEL, input="Tell me a story.", max_output_tokens=8, temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    stored = client.responses.retrieve(final.id)  # stored: store is the default
    assert stored.output_text == final.output_text and stored.usage.output_tokens == final.usage.output_tokens


def test_a_follow_up_on_another_ingress_replica_continues_the_conversation(base_url, redis_server):
    _, secret = create_key(redis_server.url, "responses-turns")
    first, first_request = create(sdk(base_url, secret), input="Hi, I am Ada.", max_output_tokens=6)
    # New connections until the follow-up lands on the other ingress replica.
    for _ in range(12):
        second, second_request = create(
            sdk(base_url, secret), input="What is my name?", max_output_tokens=6, previous_response_id=first.id
        )
        if ingress_pid(second_request) != ingress_pid(first_request):
            break
    else:
        raise AssertionError("every follow-up reached the first turn's ingress replica")
    assert second.previous_response_id == first.id
    # The engine saw the whole conversation: as many input tokens as chat counts for it.
    conversation = [
        {"role": "user", "content": "Hi, I am Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    chat = sdk(base_url, secret).chat.completions.create(
        model=MODEL, messages=conversation, max_tokens=6, temperature=0
    )
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    items = sdk(base_url, secret).responses.input_items.list(second.id)
    assert [item.content[0].text for item in items.data] == ["What is my name?"]  # its own input


def test_assistant_messages_vllm_reads_only_in_part_are_read_whole(base_url, redis_server):
    """An assistant message with no parts (vLLM's own answer for an empty output, so
    what a continuation of one sends), a refusal, or two parts: vLLM read only the
    first part's text and failed on the first two with a 500 (found by the soak).
    The engine now sees all of each one's text, as chat counts it."""
    _, secret = create_key(redis_server.url, "responses-assistant-parts")

    def said(*parts):
        return {
            "type": "message",
            "role": "assistant",
            "id": f"msg_{uuid.uuid4().hex}",
            "status": "completed",
            "content": list(parts),
        }

    def part(text):
        return {"type": "output_text", "text": text, "annotations": []}

    turns = [said(), said({"type": "refusal", "refusal": "No."}), said(part("Yes, "), part("Ada."))]
    conversation, items = [{"role": "user", "content": "Hi, I am Ada."}], [{"role": "user", "content": "Hi, I am Ada."}]
    for turn, content in zip(turns, ["", "No.", "Yes, Ada."], strict=True):
        conversation += [{"role": "assistant", "content": content}, {"role": "user", "content": "Again?"}]
        items += [turn, {"role": "user", "content": "Again?"}]
    response, _ = create(sdk(base_url, secret), input=items, max_output_tokens=4)
    chat = sdk(base_url, secret).chat.completions.create(
        model=MODEL, messages=conversation, max_tokens=4, temperature=0
    )
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content


def test_another_key_can_neither_read_nor_continue_nor_delete_a_response(base_url, redis_server):
    _, owner = create_key(redis_server.url, "responses-owner")
    _, intruder = create_key(redis_server.url, "responses-intruder")
    response, _ = create(sdk(base_url, owner), input="secret plans", max_output_tokens=2)
    other = sdk(base_url, intruder)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(response.id)
    with pytest.raises(openai.NotFoundError):
        create(other, input="and then?", previous_response_id=response.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(response.id)
    owned = sdk(base_url, owner)
    assert owned.responses.retrieve(response.id).id == response.id  # untouched by the attempts
    owned.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        owned.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):  # a deleted response cannot be continued
        create(owned, input="and then?", previous_response_id=response.id, max_output_tokens=2)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "store": "yes"}, "store"),
        ({"input": {"role": "user"}}, "input"),
        ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": [{"role": "robot", "content": "x"}]}, None),  # vLLM's own validation
        # no server-side fetch of a URL the model's media policy does not allow
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "http://169.254.169.254/latest/meta-data"}],
                    }
                ]
            },
            "messages",
        ),
    ],
)
def test_bad_requests_are_a_400(base_url, redis_server, body, param):
    _, secret = create_key(redis_server.url, f"responses-bad-{uuid.uuid4().hex[:8]}")
    response = httpx.post(
        base_url + "/v1/responses",
        json={"model": MODEL, **body},
        timeout=60,
        headers={"authorization": f"Bearer {secret}"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_a_function_call_and_its_output_continue_through_previous_response_id(base_url, redis_server):
    _, secret = create_key(redis_server.url, "responses-tools")
    client = sdk(base_url, secret)
    called, _ = create(
        client,
        input="Weather in Oslo?",
        tools=[WEATHER],
        max_output_tokens=60,
        tool_choice={"type": "function", "name": "get_weather"},
    )
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Oslo", "Lima")
    answer, _ = create(
        client,
        previous_response_id=called.id,
        tools=[WEATHER],
        max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
    )
    assert answer.previous_response_id == called.id and answer.status in ("completed", "incomplete")
    assert answer.usage.input_tokens > called.usage.input_tokens  # the call and its output were in the input


def test_text_format_json_schema_is_followed(base_url, redis_server):
    _, secret = create_key(redis_server.url, "responses-schema")
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    response, _ = create(
        sdk(base_url, secret),
        input="Is water wet?",
        max_output_tokens=30,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}},
    )
    assert json.loads(response.output_text)["answer"] in ("yes", "no")


def test_input_items_are_listed_newest_first_and_paged(base_url, redis_server):
    _, secret = create_key(redis_server.url, "responses-items")
    client = sdk(base_url, secret)
    texts = ["one", "two", "three"]
    response, _ = create(client, input=[{"role": "user", "content": text} for text in texts], max_output_tokens=2)
    newest_first = client.responses.input_items.list(response.id)
    assert [item.content[0].text for item in newest_first.data] == texts[::-1]
    first = client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [item.content[0].text for item in first.data] == texts[:2] and first.has_more
    rest = client.responses.input_items.list(response.id, order="asc", after=first.data[-1].id)
    assert [item.content[0].text for item in rest.data] == texts[2:] and not rest.has_more
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(response.id, limit=1000)
