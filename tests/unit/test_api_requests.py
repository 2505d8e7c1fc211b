"""Pure logic: what the ingress itself checks before routing."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.errors import OpenAIError, from_engine_error
from serve_app.wire import api_requests
from serve_app.wire.api_requests import (
    MAX_JSON_VALUES,
    OPERATIONS,
    check_message_count,
    check_metadata,
    list_params,
    parse_json_object,
    validate_request,
)


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


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000,  # json.loads itself would raise RecursionError
        b'{"a": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
        b'{"a": ' + b"[" * 101 + b"]" * 101 + b"}",
        b'{"a": ' + b'{"b": ' * 200 + b"1" + b"}" * 200 + b"}",
    ],
)
def test_deep_json_is_a_400_naming_the_problem(raw):
    with pytest.raises(OpenAIError) as caught:
        parse_json_object(raw)
    assert caught.value.status == 400 and caught.value.code == "json_too_deep"


def test_many_brackets_at_a_shallow_depth_pass():
    body = {"prompt": [[1, 2]] * 10_000, "tools": [{"a": [{"b": {}}]}] * 50}
    assert parse_json_object(json.dumps(body).encode()) == body
    nested = {"a": 0}
    for _ in range(98):  # 99 levels with the outer object: within the limit
        nested = {"a": nested}
    assert parse_json_object(json.dumps(nested).encode()) == nested


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xfe{}", b'{"a": "\xc3\x28"}', b'{"n": ' + b"9" * 100_000 + b"}", b"", b"{", b"[]", b"null", b"\x00"],
)
def test_unparseable_bodies_are_a_400(raw):
    with pytest.raises(OpenAIError) as caught:
        parse_json_object(raw)
    assert caught.value.status == 400


@pytest.mark.parametrize(
    "raw",
    [
        b'{"temperature": NaN}',
        b'{"temperature": Infinity}',
        b'{"top_p": -Infinity}',
        b'{"temperature": 1e999}',
        b'{"content": "\\ud800"}',
        b'{"messages": [{"content": "a \\udfff b"}]}',
        b'{"\\ud83d": 1}',
    ],
)
def test_non_json_numbers_and_lone_surrogates_are_a_400(raw):
    with pytest.raises(OpenAIError) as caught:
        parse_json_object(raw)
    assert caught.value.status == 400


def test_surrogate_pairs_and_ordinary_floats_pass():
    assert parse_json_object(b'{"content": "\\ud83d\\ude00", "temperature": 0.7, "x": 1e300}') == {
        "content": "\U0001f600",
        "temperature": 0.7,
        "x": 1e300,
    }


def test_admin_bodies_use_the_same_400_as_requests():
    from serve_app.admin import operations as admin

    with pytest.raises(OpenAIError) as caught:
        admin._parse(admin.NewKey, {"name": "k", "requests_per_minute": -1})
    assert caught.value.status == 400 and caught.value.param == "requests_per_minute"
    assert caught.value.code == "invalid_value" and "requests_per_minute" in caught.value.message
    with pytest.raises(OpenAIError) as caught:
        admin._parse(admin.NewKey, {})
    assert caught.value.code == "missing_required_parameter" and caught.value.param == "name"


@pytest.mark.parametrize(
    "body, ok",
    [
        ({"model": "m", "prompt": "hi"}, True),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, True),
        ({"model": "m"}, False),  # neither
        ({"model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, False),  # both
        ({"model": "m", "prompt": ["a", "b"]}, False),
        ({"model": "m", "messages": []}, False),
        ({"model": "m", "prompt": "hi", "stream": True}, False),
    ],
)
def test_tokenize_takes_a_prompt_or_messages(body, ok):
    if ok:
        assert parse(body, "tokenize")[1].model == "m"
    else:
        with pytest.raises(OpenAIError) as caught:
            parse(body, "tokenize")
        assert caught.value.status == 400


@pytest.mark.parametrize("tokens", [[1, "2"], "12", [1.5], None, [True]])
def test_detokenize_takes_a_list_of_integers(tokens):
    with pytest.raises(OpenAIError) as caught:
        parse({"model": "m", "tokens": tokens}, "detokenize")
    assert caught.value.status == 400 and caught.value.param == "tokens"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),  # required by Anthropic
        ({"model": "m", "max_tokens": "9", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        (
            {"model": "m", "max_tokens": 9, "messages": [{"role": "system", "content": "hi"}]},
            "messages",
        ),  # 'system' field
        ({"model": "m", "max_tokens": 9, "messages": []}, "messages"),
        ({"max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ],
)
def test_anthropic_messages_envelope(body, param):
    with pytest.raises(OpenAIError) as caught:
        parse(body, "messages")
    assert caught.value.status == 400 and caught.value.param == param
    ok = {"model": "m", "max_tokens": 9, "system": "be brief", "messages": [{"role": "user", "content": "hi"}]}
    assert parse(ok, "messages")[1].max_tokens == 9


@pytest.mark.parametrize("limit", ["\u00b2", "\uff11", "1" * 40, "-1", "0", "101", " 5", "5.0", "x" * 10_000])
def test_a_listing_limit_is_ascii_digits_in_range_or_a_400_that_does_not_echo_it_whole(limit):
    with pytest.raises(OpenAIError) as caught:
        list_params({"limit": limit})
    assert caught.value.status == 400 and caught.value.param == "limit"
    assert len(caught.value.message) < 200


def test_a_listing_limit_in_range_is_read():
    assert list_params({"limit": "100", "order": "asc", "after": "x"}) == {"limit": 100, "order": "asc", "after": "x"}
    assert list_params({})["limit"] == 20


@pytest.mark.parametrize(
    "metadata",
    [
        {str(i): "v" for i in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
        {"k": 1},
        ["k", "v"],
        "k=v",
    ],
)
def test_metadata_beyond_openais_bounds_is_a_400(metadata):
    with pytest.raises(OpenAIError) as caught:
        check_metadata(metadata)
    assert caught.value.status == 400 and caught.value.param == "metadata"


def test_metadata_within_openais_bounds_passes():
    check_metadata(None)
    check_metadata({str(i): "v" * 512 for i in range(16)})


# What the loop may be made to parse and validate (MAX_JSON_VALUES, check_message_count):
# bounded by counts, checked before the work they bound.

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=',{["]}a\\ ', max_size=6),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=3), children, max_size=5),
    max_leaves=40,
)


def values_in(value) -> int:
    inner = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return 1 + sum(values_in(child) for child in inner)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
def test_the_value_count_read_from_the_bytes_is_never_below_the_values(document):
    # Strings of commas and brackets, escaped or not, only add to the count.
    for raw in (json.dumps(document).encode(), json.dumps(document, separators=(",", ":")).encode()):
        marks = sum(raw.count(mark) for mark in (b",", b"{", b"["))
        assert values_in(document) <= marks + 1


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "prompt": [' + b"7," * MAX_JSON_VALUES + b"7]}",  # token ids
        b'{"model": "m", "x": [' + b"[]," * MAX_JSON_VALUES + b"[]]}",  # empty arrays
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "a"}] * (MAX_JSON_VALUES // 2)}).encode(),
        json.dumps({"model": "m", "prompt": "a, b" * MAX_JSON_VALUES}).encode(),  # commas in a text count too
    ],
    ids=["token-ids", "empty-arrays", "one-letter-messages", "commas-in-text"],
)
def test_a_body_that_may_hold_more_values_than_the_bound_is_refused_before_it_is_parsed(raw, monkeypatch):
    parsed = []
    monkeypatch.setattr(api_requests.json, "loads", lambda *args, **kwargs: parsed.append(1))
    with pytest.raises(OpenAIError) as caught:
        parse_json_object(raw)
    assert caught.value.status == 400 and caught.value.code == "json_too_large"
    assert f"{MAX_JSON_VALUES:,}" in caught.value.message
    assert parsed == []  # refused from its bytes alone


def test_a_body_at_the_bound_is_parsed():
    prompt = [7] * (MAX_JSON_VALUES - 8)
    raw = json.dumps({"model": "m", "prompt": prompt}, separators=(",", ":")).encode()
    assert sum(raw.count(mark) for mark in (b",", b"{", b"[")) <= MAX_JSON_VALUES
    assert parse_json_object(raw)["prompt"] == prompt


def test_more_messages_than_the_context_has_tokens_is_a_400_naming_the_parameter():
    check_message_count([{"role": "user"}] * 2048, 2048)
    check_message_count("not a list: the envelope's business", 1)
    with pytest.raises(OpenAIError) as caught:
        check_message_count([{"role": "user"}] * 2049, 2048)
    error = caught.value
    assert (error.status, error.param, error.code) == (400, "messages", "array_above_max_length")
    assert "maximum length 2048" in error.message and "length 2049" in error.message
    with pytest.raises(OpenAIError) as caught:
        check_message_count(["x"] * 3, 2, param="input")
    assert caught.value.param == "input"


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": ["user"]}],  # unhashable: a 400, not a TypeError
        [{"role": {"a": 1}}],
        [{"role": None}],
        [{"content": "no role"}],
        ["user"],
        [["role", "user"]],
        [{"role": "user"}, 7],
        [{"role": "robot"}],
    ],
)
def test_every_message_must_be_an_object_with_a_known_role(messages):
    for operation, body in (
        ("chat", {"model": "m", "messages": messages}),
        ("messages", {"model": "m", "max_tokens": 1, "messages": messages}),
        ("tokenize", {"model": "m", "messages": messages}),
    ):
        with pytest.raises(OpenAIError) as caught:
            validate_request(OPERATIONS[operation], body)
        assert caught.value.status == 400 and caught.value.param == "messages", operation


@pytest.mark.parametrize(
    "prompt, ok",
    [
        ("text", True),
        ([], True),
        (["a", "b"], True),
        ([1, 2], True),
        ([[1, 2], [3]], True),
        ([True], False),  # bool is not a token id
        ([[1, False]], False),
        ([1, "2"], False),
        (["a", [1]], False),
        ([[[1]]], False),
        ([1.0], False),
        ({"a": 1}, False),
        (None, False),
    ],
)
def test_a_prompt_is_text_texts_token_ids_or_lists_of_token_ids(prompt, ok):
    for operation, name in (("completions", "prompt"), ("embeddings", "input")):
        body = {"model": "m", name: prompt}
        if ok:
            validate_request(OPERATIONS[operation], body)
        else:
            with pytest.raises(OpenAIError) as caught:
                validate_request(OPERATIONS[operation], body)
            assert caught.value.status == 400 and caught.value.param == name
