"""Pure logic: reasoning_content is sent beside vLLM's reasoning field."""

import json

from replicas.reasoning import add_to_response, add_to_stream


def test_full_response_gets_reasoning_content():
    response = {
        "choices": [
            {"message": {"role": "assistant", "content": "4", "reasoning": "2+2"}},
            {"message": {"content": "x"}},
        ]
    }
    add_to_response(response)
    assert response["choices"][0]["message"]["reasoning_content"] == "2+2"
    assert "reasoning_content" not in response["choices"][1]["message"]


def test_stream_events_get_reasoning_content_and_others_are_untouched():
    thinking = {"id": "c", "choices": [{"index": 0, "delta": {"reasoning": "hm"}, "finish_reason": None}]}
    answer = {"id": "c", "choices": [{"index": 0, "delta": {"content": "4"}, "finish_reason": None}]}
    text = f"data: {json.dumps(thinking)}\n\ndata: {json.dumps(answer)}\n\ndata: [DONE]\n\n"
    out = add_to_stream(text)
    events = out.split("\n\n")
    assert json.loads(events[0][6:])["choices"][0]["delta"] == {"reasoning": "hm", "reasoning_content": "hm"}
    assert events[1] == f"data: {json.dumps(answer)}"
    assert events[2:] == ["data: [DONE]", ""]


def test_stream_without_reasoning_is_returned_as_is():
    text = 'data: {"choices":[{"delta":{"content":"the reasoning is"}}]}\n\n'
    assert add_to_stream(text) is text


def test_a_coalesced_first_delta_loses_the_start_tag_vllm_left_in_it():
    # vLLM 0.32's thinking parser returns the delta's whole text as reasoning when the
    # start token comes with later tokens in one delta (several tokens per chunk).
    first = {"choices": [{"index": 0, "delta": {"reasoning": "<think>imow"}}]}
    later = {"choices": [{"index": 0, "delta": {"reasoning": "ab<think>"}}]}
    text = f"data: {json.dumps(first)}\n\ndata: {json.dumps(later)}\n\n"
    events = add_to_stream(text, "<think>").split("\n\n")
    assert json.loads(events[0][6:])["choices"][0]["delta"] == {"reasoning": "imow", "reasoning_content": "imow"}
    assert json.loads(events[1][6:])["choices"][0]["delta"]["reasoning_content"] == "ab<think>"
    # Without a start tag (a parser that has none), nothing is taken out.
    assert json.loads(add_to_stream(text).split("\n\n")[0][6:])["choices"][0]["delta"]["reasoning"] == "<think>imow"


def test_the_thinking_parsers_start_tag_is_read_from_vllm():
    from replicas.vllm_engine import reasoning_start_tag

    assert reasoning_start_tag("deepseek_r1") == "<think>"
    assert reasoning_start_tag(None) is None
    assert reasoning_start_tag("no-such-parser") is None
