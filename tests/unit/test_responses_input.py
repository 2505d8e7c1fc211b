"""An assistant message in a Responses ``input`` as vLLM can read it: one
``output_text`` part with all its text (replicas/openai_json.py). vLLM reads only
the first part's ``text``; these are the shapes it failed on with a 500."""

from __future__ import annotations

import copy

import pytest

from replicas.openai_json import readable_responses_input


def assistant(*parts):
    return {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "content": list(parts)}


def text(value):
    return {"type": "output_text", "text": value, "annotations": []}


def read(*items):
    body = {"model": "m", "input": [{"role": "user", "content": "hi"}, *items]}
    readable_responses_input(body)
    return body["input"][1:]


@pytest.mark.parametrize(
    "parts, expected",
    [
        ([], ""),  # vLLM's own answer for an empty output, continued
        ([{"type": "refusal", "refusal": "no"}], "no"),
        ([text("a"), text("b")], "ab"),
        ([text("a"), {"type": "refusal", "refusal": "!"}], "a!"),
    ],
)
def test_an_assistant_message_becomes_one_text_part_with_all_its_text(parts, expected):
    [item] = read(assistant(*parts))
    assert item["content"] == [text(expected)]
    assert item["id"] == "msg_1" and item["role"] == "assistant"


def test_what_vllm_reads_already_and_what_its_validator_refuses_are_left_alone():
    untouched = [
        assistant(text("kept")),
        assistant({"type": "output_text", "text": 7}),  # a 400 from the validator, not hidden
        assistant("not a part"),
        {"role": "assistant", "content": "a string"},
        {"role": "user", "content": []},
        {"type": "function_call_output", "call_id": "c", "output": "x"},
    ]
    assert read(*copy.deepcopy(untouched)) == untouched


@pytest.mark.parametrize("body", [{"input": "text"}, {"input": None}, {}, {"input": [None, 3, "s"]}])
def test_an_input_that_is_not_a_list_of_items_is_left_to_the_validator(body):
    before = copy.deepcopy(body)
    readable_responses_input(body)
    assert body == before


def test_vllm_reads_every_rewritten_message_without_raising():
    """The rewritten items through vLLM's own validator and input reader."""
    from pydantic import TypeAdapter
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages

    items = [assistant(), assistant({"type": "refusal", "refusal": "no"}), assistant(text("a"), text("b"))]
    body = {"model": "m", "input": [{"role": "user", "content": "hi"}, *items, {"role": "user", "content": "and?"}]}
    readable_responses_input(body)
    request = TypeAdapter(ResponsesRequest).validate_python(body)
    messages = construct_input_messages(request_input=request.input)
    assert [m.get("content") for m in messages if m["role"] == "assistant"] == ["", "no", "ab"]
