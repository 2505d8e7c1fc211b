import json

from contract.replica_wire import Usage
from serve_app.wire.sse import DONE, STREAM_SHAPES, take_usage

USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
CONTENT = 'data: {"id":"x","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE_EVENT = f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': USAGE})}\n\n"


def test_usage_is_read_and_kept_when_asked():
    item = CONTENT + USAGE_EVENT + DONE
    assert take_usage(item, keep=True) == (item, Usage(3, 2))


def test_usage_event_is_hidden_when_not_asked():
    assert take_usage(CONTENT + USAGE_EVENT + DONE, keep=False) == (CONTENT + DONE, Usage(3, 2))
    assert take_usage(USAGE_EVENT + DONE, keep=False) == (DONE, Usage(3, 2))


def test_stream_without_usage_event_is_untouched():
    item = CONTENT + DONE
    assert take_usage(item, keep=False) == (item, None)


# -- Anthropic's stream shape (vLLM's Messages API) ---------------------------------


def anthropic_event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


DELTA = anthropic_event(
    "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}}
)
MESSAGE_DELTA = anthropic_event(
    "message_delta",
    {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn"},
        "usage": {"input_tokens": 7, "output_tokens": 2, "cache_read_input_tokens": 3},
    },
)
STOP = anthropic_event("message_stop", {"type": "message_stop"})


def test_an_anthropic_stream_is_charged_the_usage_of_its_message_delta_cached_input_included():
    shape = STREAM_SHAPES["anthropic"]
    assert shape.usage(DELTA, keep=False) == (DELTA, None)  # content: not parsed
    item = DELTA + MESSAGE_DELTA
    # Always kept: Anthropic's client reads it. Its cache reads are part of the prompt, and cached.
    assert shape.usage(item, keep=False) == (item, Usage(10, 2, cached_prompt_tokens=3))
    assert shape.usage(STOP, keep=False) == (STOP, None)


def test_an_anthropic_stream_vllm_ended_with_an_error_event_has_failed():
    shape = STREAM_SHAPES["anthropic"]
    error = anthropic_event("error", {"type": "error", "error": {"type": "api_error", "message": "boom"}})
    assert shape.failed(DELTA + error) and not shape.failed(DELTA + MESSAGE_DELTA + STOP)
    assert not STREAM_SHAPES["openai"].failed(DELTA)


def test_the_openai_shape_reads_only_the_final_item():
    shape = STREAM_SHAPES["openai"]
    assert shape.usage(CONTENT, keep=False) == (CONTENT, None)
    assert shape.usage(CONTENT + USAGE_EVENT + DONE, keep=False) == (CONTENT + DONE, Usage(3, 2))


def test_anthropic_usage_without_a_usage_object_is_unknown():
    assert Usage.from_input_output(None) is None and Usage.from_input_output({}) is None
    assert Usage.from_input_output({"input_tokens": 4, "output_tokens": 1, "cache_creation_input_tokens": 2}) == Usage(
        6, 1
    )


def test_a_responses_stream_is_charged_the_usage_of_its_completed_response():
    shape = STREAM_SHAPES["responses"]
    delta = 'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi"}\n\n'
    completed = (
        'event: response.completed\ndata: {"type":"response.completed","response":'
        '{"id":"resp_1","usage":{"input_tokens":6,"output_tokens":4,"total_tokens":10}}}\n\n'
    )
    assert shape.usage(delta, keep=False) == (delta, None)
    assert shape.usage(delta + completed, keep=False) == (delta + completed, Usage(6, 4))
    assert shape.failed('event: response.failed\ndata: {"type":"response.failed"}\n\n') and not shape.failed(delta)
