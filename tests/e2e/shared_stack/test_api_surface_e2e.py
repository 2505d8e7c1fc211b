"""The OpenAI surface beyond basic chat, end to end through the openai SDK:
completions, embeddings (all-MiniLM-L6-v2 on vLLM), model cards, and chat's
full parameter set (docs/api.md, "Parameters"): each parameter works, or is refused
with a 400 naming it.
"""

from __future__ import annotations

import base64
import json
import math
import struct

import openai
import openai_spec
import pytest
from http_checks import assert_error_envelope, sse_events
from stack import demo_token_id

from shared_stack.stack_models import RERANKER

pytestmark = pytest.mark.e2e

CHAT_MODEL = "tiny-llama"
EMBEDDING_MODEL = "minilm"


HELLO = [{"role": "user", "content": "Tell me about the license."}]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


# -- models -----------------------------------------------------------------------


def test_model_cards_carry_context_length_owner_and_capabilities(http):
    listed = http.get("/v1/models").json()
    openai_spec.validate(listed, "ListModelsResponse")
    cards = {card["id"]: card for card in listed["data"]}
    assert list(cards) == [CHAT_MODEL, EMBEDDING_MODEL, RERANKER["name"]]
    assert cards[CHAT_MODEL]["max_model_len"] == 2048
    assert cards[EMBEDDING_MODEL]["max_model_len"] == 256
    assert cards[CHAT_MODEL]["owned_by"] == "llm-cluster"
    assert set(cards[CHAT_MODEL]["capabilities"]) == {"chat", "completions", "messages", "responses"}
    assert cards[EMBEDDING_MODEL]["capabilities"] == ["embeddings", "rerank", "score"]
    one = http.get(f"/v1/models/{EMBEDDING_MODEL}").json()
    openai_spec.validate(one, "Model")
    assert one == cards[EMBEDDING_MODEL]


# -- completions -------------------------------------------------------------------


def test_completion_matches_spec_and_usage_adds_up(http):
    response = http.post(
        "/v1/completions", json={"model": CHAT_MODEL, "prompt": "The license", "max_tokens": 6, "temperature": 0}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    openai_spec.validate(body, "CreateCompletionResponse")
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + 6


def test_completion_default_max_tokens_is_openais_16(client):
    completion = client.completions.create(model=CHAT_MODEL, prompt="The license", temperature=0)
    assert completion.usage.completion_tokens <= 16


def test_completion_prompt_list_gives_one_choice_per_prompt(client):
    completion = client.completions.create(
        model=CHAT_MODEL, prompt=["The license", "Permission is"], max_tokens=4, temperature=0
    )
    assert sorted(choice.index for choice in completion.choices) == [0, 1]


def test_completion_token_id_prompt(client):
    completion = client.completions.create(model=CHAT_MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert completion.usage.prompt_tokens == 4


def test_completion_echo_repeats_the_prompt(client):
    completion = client.completions.create(
        model=CHAT_MODEL, prompt="The license", max_tokens=4, temperature=0, echo=True
    )
    assert completion.choices[0].text.startswith("The license")


def test_completion_n_and_logprobs(http):
    response = http.post(
        "/v1/completions",
        json={
            "model": CHAT_MODEL,
            "prompt": "The",
            "max_tokens": 3,
            "n": 2,
            "temperature": 1,
            "seed": 3,
            "logprobs": 2,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    openai_spec.validate(body, "CreateCompletionResponse")
    assert len(body["choices"]) == 2
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 3
    assert all(1 <= len(top) <= 3 for top in logprobs["top_logprobs"])


def test_completion_suffix_is_refused_naming_it(http):
    # vLLM cannot fill in the middle; saying so beats ignoring the suffix.
    response = http.post("/v1/completions", json={"model": CHAT_MODEL, "prompt": "a", "suffix": "z"})
    error = assert_error_envelope(response, 400)
    assert "suffix" in error["message"]


def test_completion_stream_chunks_match_spec_and_text_matches_unary(http, client):
    request = {"model": CHAT_MODEL, "prompt": "The license", "max_tokens": 8, "temperature": 0}
    unary = client.completions.create(**request).choices[0].text
    with http.stream(
        "POST", "/v1/completions", json={**request, "stream": True, "stream_options": {"include_usage": True}}
    ) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    # Like OpenAI's own completion streams, chunks before the last say
    # finish_reason null, which the spec (it has no chunk schema for
    # completions) does not allow: validate them with that one allowance.
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    for chunk in chunks:
        for choice in chunk["choices"]:
            choice["finish_reason"] = choice["finish_reason"] or "length"
        openai_spec.validate(chunk, "CreateCompletionResponse")
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == unary
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_completion_stream_hides_usage_unless_asked(client):
    chunks = list(client.completions.create(model=CHAT_MODEL, prompt="The", max_tokens=3, temperature=0, stream=True))
    assert chunks and all(chunk.usage is None for chunk in chunks)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": CHAT_MODEL}, "prompt"),
        ({"model": CHAT_MODEL, "prompt": {"text": "x"}}, "prompt"),
        ({"model": CHAT_MODEL, "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"model": CHAT_MODEL, "prompt": "x", "logprobs": "many"}, "logprobs"),
        ({"model": EMBEDDING_MODEL, "prompt": "x"}, "model"),
    ],
)
def test_completion_bad_input_is_400_naming_the_parameter(http, body, param):
    error = assert_error_envelope(http.post("/v1/completions", json=body), 400)
    assert error["param"] == param or param in error["message"], error


# -- embeddings ---------------------------------------------------------------------


SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."]


def test_embeddings_are_all_minilm(http, client):
    response = http.post("/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": SENTENCES})
    assert response.status_code == 200, response.text
    openai_spec.validate(response.json(), "CreateEmbeddingResponse")
    result = client.embeddings.create(model=EMBEDDING_MODEL, input=SENTENCES, encoding_format="float")
    vectors = [item.embedding for item in result.data]
    assert [item.index for item in result.data] == [0, 1, 2]
    assert all(len(vector) == 384 for vector in vectors)
    # A trained sentence encoder, not random weights: paraphrases are close,
    # unrelated sentences are not (all-MiniLM-L6-v2 gives about 0.76 and -0.1).
    assert cosine(vectors[0], vectors[1]) > 0.6
    assert cosine(vectors[0], vectors[2]) < 0.2
    assert result.usage.prompt_tokens > 0 and result.usage.total_tokens == result.usage.prompt_tokens


def test_embedding_base64_decodes_to_the_float_vector(http):
    def embed(encoding):
        response = http.post(
            "/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": SENTENCES[0], "encoding_format": encoding}
        )
        assert response.status_code == 200, response.text
        return response.json()["data"][0]["embedding"]

    floats = embed("float")
    packed = base64.b64decode(embed("base64"))
    decoded = struct.unpack(f"<{len(packed) // 4}f", packed)
    assert len(decoded) == 384
    assert max(abs(a - b) for a, b in zip(decoded, floats)) < 1e-6


def test_embedding_accepts_token_ids(client):
    result = client.embeddings.create(model=EMBEDDING_MODEL, input=[[101, 2023, 102]], encoding_format="float")
    assert len(result.data[0].embedding) == 384 and result.usage.prompt_tokens == 3


def test_embedding_input_longer_than_the_model_is_400(http):
    response = http.post("/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": "word " * 400})
    error = assert_error_envelope(response, 400)
    assert "256" in error["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": EMBEDDING_MODEL}, "input"),
        ({"model": EMBEDDING_MODEL, "input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"model": CHAT_MODEL, "input": "x"}, "model"),
        ({"model": EMBEDDING_MODEL, "input": "x", "dimensions": 2}, "dimensions"),
    ],
)
def test_embedding_bad_input_is_400_naming_the_parameter(http, body, param):
    error = assert_error_envelope(http.post("/v1/embeddings", json=body), 400)
    assert error["param"] == param or param in error["message"], error


def test_chat_on_the_embedding_model_is_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=EMBEDDING_MODEL, messages=HELLO)
    assert caught.value.body["param"] == "model"


# -- chat: every parameter ----------------------------------------------------------


def chat(http, **params):
    response = http.post("/v1/chat/completions", json={"model": CHAT_MODEL, "messages": HELLO, **params})
    return response


def chat_ok(http, **params) -> dict:
    response = chat(http, **params)
    assert response.status_code == 200, response.text
    body = response.json()
    openai_spec.validate(body, "CreateChatCompletionResponse")
    return body


def test_every_message_shape_is_accepted(http):
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "You answer questions."}], "name": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "What is the weather?"}], "name": "alice"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks!"},
    ]
    body = chat_ok(http, messages=messages, max_tokens=4)
    assert body["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 1},
        {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
        {"user": "user-1234", "metadata": {"team": "search"}, "store": False, "service_tier": "auto"},
        {"stop": "x"},
        {"stop": ["x", "y"]},
        {"skip_special_tokens": False, "chat_template_kwargs": {"add_generation_prompt": True}},
        {"response_format": {"type": "text"}},
        {"logprobs": False},
        {"parallel_tool_calls": True},
        {"prediction": {"type": "content", "content": "ignored"}},
    ],
    ids=lambda params: ",".join(params),
)
def test_sampling_and_metadata_parameters_are_accepted(http, params):
    chat_ok(http, max_tokens=4, **params)


def test_max_completion_tokens_limits_like_max_tokens(http):
    body = chat_ok(http, max_completion_tokens=3, temperature=0)
    assert body["usage"]["completion_tokens"] <= 3


def test_min_tokens_with_ignore_eos_generates_exactly_max(http):
    body = chat_ok(http, min_tokens=9, max_tokens=9, ignore_eos=True, temperature=0)
    assert body["usage"]["completion_tokens"] == 9
    assert body["choices"][0]["finish_reason"] == "length"


def first_token_id(http, **params) -> int:
    body = chat_ok(http, max_tokens=1, temperature=0, logprobs=True, return_tokens_as_token_ids=True, **params)
    return int(body["choices"][0]["logprobs"]["content"][0]["token"].removeprefix("token_id:"))


def test_logit_bias_bans_a_token(http):
    greedy = first_token_id(http)
    assert first_token_id(http, logit_bias={str(greedy): -100}) != greedy


def test_include_stop_str_in_output_keeps_the_stop_string(http):
    text = chat_ok(http, max_tokens=24, temperature=0)["choices"][0]["message"]["content"]
    stop = text[4:7]
    assert len(stop) == 3 and stop.strip(), text
    cut = chat_ok(http, max_tokens=24, temperature=0, stop=[stop])["choices"][0]["message"]["content"]
    kept = chat_ok(http, max_tokens=24, temperature=0, stop=[stop], include_stop_str_in_output=True)
    assert kept["choices"][0]["message"]["content"] == cut + stop


@pytest.mark.parametrize("top", [0, 5, 20])
def test_logprobs_with_top_logprobs_up_to_20(http, top):
    body = chat_ok(http, max_tokens=2, logprobs=True, top_logprobs=top, temperature=0)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(len(item["top_logprobs"]) == top for item in content)


def test_json_schema_response_validates_against_the_schema(http):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["ada", "grace", "alan"]},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    body = chat_ok(
        http,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
    )
    choice = body["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert choice["finish_reason"] == "stop"


def test_json_object_response_is_json(http):
    # A random-weight model would write one endless string; the bias makes it
    # prefer closing quotes and braces, and the grammar must still make JSON.
    bias = {str(demo_token_id('"')): 30, str(demo_token_id("}")): 20}
    body = chat_ok(http, max_tokens=200, temperature=0, response_format={"type": "json_object"}, logit_bias=bias)
    content = body["choices"][0]["message"]["content"]
    assert isinstance(json.loads(content), dict), content
    assert body["choices"][0]["finish_reason"] == "stop"


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
def test_forced_tool_choice_returns_a_well_formed_tool_call(http, tool_choice):
    body = chat_ok(
        http, max_tokens=100, temperature=0, tools=[WEATHER_TOOL], tool_choice=tool_choice, parallel_tool_calls=False
    )
    choice = body["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert calls and calls[0]["type"] == "function" and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"])["city"] in {"Oslo", "Lima"}
    assert choice["finish_reason"] == "tool_calls"


def test_tool_choice_auto_answers_with_text_or_well_formed_calls(http):
    # The model decides; the Hermes parser turns <tool_call> output into calls.
    body = chat_ok(http, max_tokens=16, temperature=0, tools=[WEATHER_TOOL], tool_choice="auto")
    choice = body["choices"][0]
    for call in choice["message"].get("tool_calls") or []:
        json.loads(call["function"]["arguments"])
    if not choice["message"].get("tool_calls"):
        assert choice["message"]["content"] and choice["finish_reason"] in ("stop", "length")


def test_tool_choice_none_never_calls_a_tool(http):
    body = chat_ok(http, max_tokens=8, tools=[WEATHER_TOOL], tool_choice="none")
    assert not body["choices"][0]["message"].get("tool_calls")


def test_forced_tool_call_streams_as_tool_call_deltas(client):
    stream = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=HELLO,
        max_tokens=100,
        temperature=0,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        stream=True,
    )
    arguments, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert json.loads(arguments)["city"] in {"Oslo", "Lima"}
    assert finish == "tool_calls"


@pytest.mark.parametrize(
    "params, param",
    [
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"typical_p": 0.9}, "typical_p"),
        ({"temperature": "hot"}, "temperature"),
        ({"n": 0}, "n"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"functions": [WEATHER_TOOL["function"]]}, "functions"),
        ({"audio": {"voice": "alloy", "format": "mp3"}, "modalities": ["text", "audio"]}, "audio"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"store": True}, "store"),
        ({"mirostat": 2}, "mirostat"),
        ({"no_such_parameter": 1}, "no_such_parameter"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_unsupported_or_invalid_parameters_are_400_naming_them(http, params, param):
    error = assert_error_envelope(chat(http, max_tokens=4, **params), 400)
    assert error["param"] == param or param in error["message"], error


# -- chat: context length -------------------------------------------------------------


def test_prompt_longer_than_the_context_is_400(http):
    long = [{"role": "user", "content": "license " * 3000}]
    error = assert_error_envelope(chat(http, messages=long, max_tokens=4), 400)
    assert "2048" in error["message"]


def test_prompt_plus_max_tokens_beyond_the_context_is_cut_to_fit(http):
    # vLLM's documented behaviour: generation stops at the context length.
    prompt = [{"role": "user", "content": "license " * 1950}]
    body = chat_ok(http, messages=prompt, max_tokens=1000, temperature=0)
    usage = body["usage"]
    assert usage["prompt_tokens"] > 1048
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 2048
    assert body["choices"][0]["finish_reason"] == "length"


# -- chat: images -----------------------------------------------------------------------


RED_PIXEL = (
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
)


def image_message(url: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]


def test_image_part_to_a_text_only_model_is_400(http):
    error = assert_error_envelope(chat(http, messages=image_message(RED_PIXEL), max_tokens=4), 400)
    assert "not a multimodal model" in error["message"]


@pytest.mark.parametrize(
    "url", ["http://169.254.169.254/latest/meta-data/", "https://example.com/cat.png", "file:///etc/passwd"]
)
def test_media_urls_are_refused_by_the_gateway_unless_configured(http, url):
    # URL fetching is off by default and local paths need a configured
    # directory: the gateway refuses before any replica could fetch.
    error = assert_error_envelope(chat(http, messages=image_message(url), max_tokens=4), 400)
    assert error["param"] == "messages" and error["code"] == "media_url_not_allowed", error
