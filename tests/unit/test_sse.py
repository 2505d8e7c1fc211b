import json

from contract.replica_wire import Usage
from serve_app.sse import DONE, take_usage

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
