"""Pure logic: what the ingress itself checks before routing."""

import json

import pytest

from serve_app.api_requests import OPERATIONS, parse_json_object, validate_request
from serve_app.errors import OpenAIError, from_engine_error


def parse(body, operation="chat"):
    raw = parse_json_object(body if isinstance(body, bytes) else json.dumps(body).encode())
    return raw, validate_request(OPERATIONS[operation], raw)


def test_valid_request_passes_through_untouched():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": 3, "stream": True}
    raw, chat = parse(body)
    assert raw == body
    assert chat.model == "m" and chat.stream is True


@pytest.mark.parametrize(
    "body, param, code",
    [
        (b"{", None, None),
        (b"[]", None, None),
        ({"messages": [{"role": "user", "content": "x"}]}, "model", "missing_required_parameter"),
        ({"model": "m"}, "messages", "missing_required_parameter"),
        ({"model": "m", "messages": []}, "messages", "invalid_value"),
        ({"model": "m", "messages": [{"role": "robot"}]}, "messages", "invalid_value"),
        ({"model": "m", "messages": [{"role": "user"}], "stream": "true"}, "stream", "invalid_value"),
        ({"model": "m", "messages": [{"role": "user"}], "stream_options": 1}, "stream_options", "invalid_value"),
    ],
)
def test_invalid_requests_are_400_with_param(body, param, code):
    with pytest.raises(OpenAIError) as caught:
        parse(body)
    error = caught.value
    assert error.status == 400
    assert error.param == param and error.code == code
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_engine_errors_get_openai_types_and_string_codes():
    error = from_engine_error(400, {"message": "bad n", "type": "BadRequestError", "param": "n", "code": 400})
    assert error.body() == {"error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": None}}
    assert from_engine_error(500, {"message": "boom"}).body()["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    "operation, body, param",
    [
        ("completions", {"model": "m"}, "prompt"),
        ("completions", {"model": "m", "prompt": 3}, "prompt"),
        ("completions", {"model": "m", "prompt": [{"a": 1}]}, "prompt"),
        ("embeddings", {"model": "m"}, "input"),
        ("embeddings", {"model": "m", "input": {"text": "x"}}, "input"),
        ("embeddings", {"model": "m", "input": "x", "stream": True}, "stream"),
    ],
)
def test_other_operations_reject_what_they_cannot_route(operation, body, param):
    with pytest.raises(OpenAIError) as caught:
        parse(body, operation)
    assert caught.value.status == 400 and caught.value.param == param


@pytest.mark.parametrize(
    "operation, body",
    [
        ("completions", {"model": "m", "prompt": "hi"}),
        ("completions", {"model": "m", "prompt": ["a", "b"], "echo": True}),
        ("completions", {"model": "m", "prompt": [1, 2, 3]}),
        ("embeddings", {"model": "m", "input": ["a", "b"], "encoding_format": "base64"}),
        ("embeddings", {"model": "m", "input": [[1, 2], [3]]}),
    ],
)
def test_other_operations_accept_openai_shapes(operation, body):
    raw, envelope = parse(body, operation)
    assert raw == body and envelope.model == "m"
