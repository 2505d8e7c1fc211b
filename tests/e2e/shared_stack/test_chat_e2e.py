"""Chat completions end to end: openai SDK → Ray Serve ingress → vLLM CPU replica.

One stack for the module (configs/local.yaml's models), plus a bare
``vllm serve`` of the same model for the parity checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import httpx
import openai
import openai_spec
import pytest
from http_checks import assert_error_envelope, serving_process, sse_events
from ports import free_port
from stack import call_replica, local_app_args

from shared_stack.stack_models import RERANKER

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
HELLO = [{"role": "user", "content": "Tell me about the license."}]


# -- models -----------------------------------------------------------------


def test_models_lists_the_served_models(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "minilm", RERANKER["name"]]
    openai_spec.validate(http.get("/v1/models").json(), "ListModelsResponse")
    card = http.get(f"/v1/models/{MODEL}")
    assert card.status_code == 200
    openai_spec.validate(card.json(), "Model")
    assert client.models.retrieve(MODEL).id == MODEL


def test_unknown_model_card_is_404(http):
    error = assert_error_envelope(http.get("/v1/models/no-such-model"), 404)
    assert error["code"] == "model_not_found"


# -- non-streaming ------------------------------------------------------------


def test_chat_response_matches_spec_and_usage_adds_up(http, client):
    response = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": HELLO, "max_tokens": 8, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    openai_spec.validate(body, "CreateChatCompletionResponse")
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["choices"][0]["message"]["role"] == "assistant"

    completion = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    assert completion.choices[0].message.content == body["choices"][0]["message"]["content"]


def test_max_tokens_ends_with_length(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 5


def test_stop_string_cuts_the_output(client):
    full = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    # A stop string taken from the middle of the greedy output must end it there.
    start = next(
        (i for i in range(3, len(text) - 3) if text[i : i + 3].isascii() and text[i : i + 3].isalpha()),
        None,
    )
    assert start is not None, f"no ASCII run to stop on in {text!r}"
    stop = text[start : start + 3]
    cut = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_n_gives_that_many_choices(client):
    completion = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0.9, n=3)
    assert sorted(c.index for c in completion.choices) == [0, 1, 2]


def test_seeded_sampling_repeats(client):
    def once(**sampling):
        return client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, **sampling)

    assert (
        once(temperature=0, seed=7).choices[0].message.content == once(temperature=0, seed=7).choices[0].message.content
    )
    first = once(temperature=1.0, seed=1234).choices[0].message.content
    assert first == once(temperature=1.0, seed=1234).choices[0].message.content


# -- streaming ------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2])
def test_stream_chunks_match_spec(http, n):
    request = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": 6,
        "temperature": 0.7,
        "n": n,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)

    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    for chunk in chunks:
        openai_spec.validate(chunk, "CreateChatCompletionStreamResponse")
    assert len({chunk["id"] for chunk in chunks}) == 1

    *content_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert all(chunk.get("usage") is None for chunk in content_chunks)

    for index in range(n):
        deltas = [c for chunk in content_chunks for c in chunk["choices"] if c["index"] == index]
        assert deltas[0]["delta"].get("role") == "assistant"
        assert sum(1 for c in deltas if c.get("finish_reason")) == 1
        assert deltas[-1]["finish_reason"] in ("stop", "length")


def test_stream_without_usage_has_no_usage_chunk(http):
    request = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=request) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["choices"] for chunk in chunks)
    assert all(chunk.get("usage") is None for chunk in chunks)


def test_sdk_stream_reassembles_the_same_text(client):
    full = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == full.choices[0].message.content


def test_client_disconnect_aborts_the_request_in_the_engine(base_url, api_key):
    request = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=base_url, timeout=60, headers={"authorization": f"Bearer {api_key}"}) as fresh:
        with fresh.stream("POST", "/v1/chat/completions", json=request) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in received)
            busy = call_replica(MODEL, "engine_load")
            assert busy["unfinished"] >= 1, busy
        # Leaving the block closes the connection mid-stream.

    deadline = time.monotonic() + 10
    load = call_replica(MODEL, "engine_load")
    while (load["unfinished"] or load["running"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        load = call_replica(MODEL, "engine_load")
    assert load["unfinished"] == 0 and load["running"] == 0, load


# -- bad input ----------------------------------------------------------------

BAD_REQUESTS = {
    "malformed json": (b'{"model": "tiny-llama", "messages": [', 400, None),
    "not an object": (b'["tiny-llama"]', 400, None),
    "missing messages": ({"model": MODEL}, 400, "messages"),
    "empty messages": ({"model": MODEL, "messages": []}, 400, "messages"),
    "messages not a list": ({"model": MODEL, "messages": "hello"}, 400, "messages"),
    "message not an object": ({"model": MODEL, "messages": ["hello"]}, 400, "messages"),
    "missing model": ({"messages": HELLO}, 400, "model"),
    "model not a string": ({"model": 7, "messages": HELLO}, 400, "model"),
    "stream not a bool": ({"model": MODEL, "messages": HELLO, "stream": "yes"}, 400, "stream"),
    "temperature not a number": ({"model": MODEL, "messages": HELLO, "temperature": "hot"}, 400, "temperature"),
    "negative max_tokens": ({"model": MODEL, "messages": HELLO, "max_tokens": -1}, 400, None),
    "n zero": ({"model": MODEL, "messages": HELLO, "n": 0}, 400, None),
    "bad role": ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    "unknown model": ({"model": "no-such-model", "messages": HELLO}, 404, "model"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_gets_openai_error(http, case, stream):
    body, status, param = BAD_REQUESTS[case]
    if isinstance(body, dict) and stream:
        body = {**body, "stream": body.get("stream", True)}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    error = assert_error_envelope(response, status)
    if param is not None:
        assert error["param"] == param, error


def test_sdk_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=HELLO)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])


def test_unknown_route_is_enveloped_404(http):
    assert_error_envelope(http.get("/v1/nothing-here"), 404)


def test_still_serving_after_bad_input(client):
    completion = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
    assert completion.choices[0].message.content is not None


# -- parity with bare vLLM --------------------------------------------------------


@pytest.fixture(scope="module")
def bare_vllm():
    """``vllm serve`` of the same model with the same engine options."""
    from contract.model_config import ModelConfig
    from replicas.sources import resolve_source
    from replicas.vllm_engine import vllm_serve_command

    config = ModelConfig(**local_app_args()["models"][0])
    port = free_port()
    env = {**os.environ, **config.env}
    url = f"http://127.0.0.1:{port}"
    command = vllm_serve_command(config, resolve_source(config), "127.0.0.1", port)
    with serving_process(
        command, url + "/v1/models", timeout_s=300, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


PARITY_REQUESTS = [
    dict(messages=HELLO, max_tokens=16),
    dict(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grant of patent license"}],
        max_tokens=24,
    ),
    dict(messages=HELLO, max_tokens=12, stop=["e"]),
    dict(messages=[{"role": "user", "content": "Redistribution"}], max_tokens=20, n=2, temperature=0.8, seed=11),
]


@pytest.mark.parametrize("index", range(len(PARITY_REQUESTS)))
def test_parity_with_bare_vllm(client, bare_vllm, index):
    request = dict(model=MODEL, temperature=0) | PARITY_REQUESTS[index]
    ours = client.chat.completions.create(**request)
    theirs = bare_vllm.chat.completions.create(**request)
    assert [c.message.content for c in ours.choices] == [c.message.content for c in theirs.choices]
    assert [c.finish_reason for c in ours.choices] == [c.finish_reason for c in theirs.choices]
    # The same usage, its prompt_tokens_details included; the gateway leaves out the
    # details vLLM sends as null (replicas/openai_json.py), which the SDK then keeps as extras.
    assert ours.usage.model_dump(exclude_none=True) == theirs.usage.model_dump(exclude_none=True)


def test_parity_streaming(client, bare_vllm):
    request = dict(model=MODEL, messages=HELLO, temperature=0, max_tokens=16, stream=True)

    def text(api):
        return "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(**request) if c.choices)

    assert text(client) == text(bare_vllm)


# -- engine death (last: it restarts the replica) --------------------------------


def test_a_dead_engine_ends_its_replica_and_serve_replaces_it(client, base_url, api_key):
    """A replica whose engine died exits (as `vllm serve` does) instead of
    failing requests until three health checks have failed; meanwhile clients
    get 503 with retry-after, never a 500."""
    from stack import replica_engine_processes

    engines = replica_engine_processes(MODEL)
    assert len(engines) == 1, engines
    replica = next(p for p in engines[0].parents() if "ServeReplica" in p.name() + " ".join(p.cmdline()))
    engines[0].kill()
    engines[0].wait(timeout=30)
    replica.wait(timeout=15)  # it exited by itself

    deadline = time.monotonic() + 240
    while True:
        response = httpx.post(
            base_url + "/v1/chat/completions",
            timeout=120,
            headers={"authorization": f"Bearer {api_key}"},
            json={"model": MODEL, "messages": HELLO, "max_tokens": 3},
        )
        if response.status_code == 200:
            break
        assert response.status_code == 503 and response.headers["retry-after"], (response.status_code, response.text)
        assert time.monotonic() < deadline, "the model did not come back after its engine died"
        time.sleep(2)
    assert response.json()["choices"][0]["message"]["content"] is not None
    assert len(replica_engine_processes(MODEL)) == 1
