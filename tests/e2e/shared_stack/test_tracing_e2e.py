"""Traces on the real stack (serve_app/tracing.py, replicas/tracing.py): the shared
stack exports OTLP/HTTP to a receiver this test runs (tests/otlp_receiver.py,
the official protobufs), sampling only what a client's traceparent asks for.

- A stream's trace continues the client's traceparent: the gateway's request span
  (in the model's replica: /v1 chat takes its direct route, as shipped) is its child,
  with the stages as children (the edge's hop from HAProxy, authenticate, read body,
  admission, queue, replica call), in order; the replica's span, in the model's own
  service, is a child of the replica call, and vLLM's own span
  of the request in its engine (``llm_request``: time in queue, prefill, decode,
  time to first token) is the replica span's child. The stages up to the
  first token cover the client's time to first token, less the client's own side.
  Settlement (Redis' script replacing the reservation with the usage) is a span
  too, after the answer.
- A unary call's replica span carries the usage the client got.
- Attributes name the model, the usage and the key id, never the key's secret
  nor the prompt's text.
- A refused request (a wrong key) is a trace too, with its status.
- A request without traceparent is not sampled at ratio 0, and its answer still
  carries a (not sampled) traceparent.
"""

from __future__ import annotations

import json
import secrets
import time

import httpx
import pytest

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
# /v1 chat takes the model's direct route, as shipped: the gateway's spans are made in the
# model's replica, whose process is the model's service.
SERVED_BY = f"llm-model-{MODEL}"
STAGES = ["authenticate", "read body", "admission", "queue"]


def client_context() -> tuple[str, str, str]:
    """(traceparent, trace id, span id) of a sampled client span."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def by_name(spans) -> dict:
    named = {}
    for span in spans:
        assert span.name not in named, f"two {span.name} spans: {spans}"
        named[span.name] = span
    return named


def test_a_streams_trace_continues_the_clients_and_crosses_into_the_replica(http, api_key, otlp):
    traceparent, trace_id, client_span = client_context()
    marker = "zebra-" + secrets.token_hex(4)  # prompt text that must not reach a span
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Say {marker}"}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    http.post("/v1/chat/completions", json=body).raise_for_status()  # warm: the first call's costs are not the hop's
    started = time.monotonic()
    ttft = None
    events = []
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"traceparent": traceparent}) as response:
        assert response.status_code == 200
        answered, x_request_id = response.headers["traceparent"], response.headers["x-request-id"]
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                events.append(event)
                if ttft is None and event["choices"] and event["choices"][0]["delta"].get("content") is not None:
                    ttft = time.monotonic() - started
    usage = events[-1]["usage"]
    assert answered.split("-")[1] == trace_id and answered.endswith("-01")  # the client's trace goes on

    spans = otlp.wait_for(
        trace_id,
        {"POST /v1/chat/completions", "edge", *STAGES, "replica call", "replica chat", "llm_request", "settle"},
    )
    named = by_name(spans)
    root = named["POST /v1/chat/completions"]
    assert root.parent_span_id == client_span and root.service == SERVED_BY
    assert answered.split("-")[2] == root.span_id  # the answer names the request span as the parent to go on from
    for name in [*STAGES, "replica call"]:
        assert named[name].parent_span_id == root.span_id and named[name].service == SERVED_BY, named[name]
    replica = named["replica chat"]
    assert replica.parent_span_id == named["replica call"].span_id  # the gateway's call of its replica
    assert replica.service == f"llm-model-{MODEL}" and replica.attributes["llm.replica"]
    assert "first token" in replica.events and "first token" in named["replica call"].events
    # vLLM's span of the request in its engine, joined through the context the replica hands it.
    engine = named["llm_request"]
    assert engine.parent_span_id == replica.span_id and engine.service == f"llm-model-{MODEL}"
    phases = {
        name: engine.attributes[f"gen_ai.latency.{name}"]
        for name in ("time_in_queue", "time_in_model_prefill", "time_in_model_decode", "time_to_first_token")
    }
    assert all(value >= 0 for value in phases.values()), phases
    assert engine.attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]
    assert phases["time_in_queue"] + phases["time_in_model_prefill"] <= phases["time_to_first_token"] + 0.005

    assert named["authenticate"].attributes["llm.auth.source"] in ("cache", "redis")  # the key record's source

    # In order, within the request's span.
    ends = [named[name] for name in STAGES]
    for earlier, later in zip(ends, ends[1:]):
        assert earlier.end_ns <= later.start_ns, (earlier, later)
    assert root.start_ns <= named["authenticate"].start_ns and named["replica call"].end_ns <= root.end_ns
    settle = named["settle"]  # after the answer, off the request's path: its usage replaces the reservation
    assert settle.parent_span_id == root.span_id and settle.attributes["llm.settle.status"] == "completed"
    assert settle.start_ns >= named["replica call"].events["first token"]
    if named["admission"].attributes["llm.early_start"]:
        # Sent to the engine beside its admission (the direct route's early start of a
        # stream whose key has room): the call begins once its body is read, before its
        # admission has answered.
        assert named["read body"].end_ns <= named["replica call"].start_ns <= named["admission"].end_ns
    else:
        assert named["replica call"].start_ns >= named["admission"].end_ns
    assert named["replica call"].start_ns <= replica.start_ns <= replica.events["first token"]

    # The hop from HAProxy (its time on the request) to the ingress, before the request span.
    edge = named["edge"]
    assert edge.parent_span_id == root.span_id and edge.start_ns <= edge.end_ns == root.start_ns

    # The time to the first token, from the edge's time on, against the client's.
    traced_ttft = (named["replica call"].events["first token"] - edge.start_ns) / 1e9
    print(
        f"client TTFT {ttft * 1000:.1f} ms, traced {traced_ttft * 1000:.1f} ms; stages (ms): "
        + ", ".join(
            f"{name} {named[name].seconds * 1000:.1f}" for name in ["edge", *STAGES, "replica call", "replica chat"]
        )
        + "; engine (ms): "
        + ", ".join(f"{name} {value * 1000:.1f}" for name, value in phases.items())
    )
    assert traced_ttft <= ttft + 0.005  # one clock on one machine
    assert ttft - traced_ttft <= max(0.05, 0.3 * ttft), (ttft, traced_ttft)  # the client's side and the relay

    attributes = root.attributes
    assert attributes["gen_ai.request.model"] == MODEL and attributes["http.response.status_code"] == 200
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attributes["llm.key.id"] and attributes["llm.stream"] is True
    assert attributes["llm.request_id"] == x_request_id  # joins the access log's line
    everything = repr([(span.name, span.attributes) for span in spans])
    assert api_key not in everything and marker not in everything


def test_a_unary_calls_replica_span_carries_its_usage(http, otlp):
    traceparent, trace_id, _ = client_context()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = http.post("/v1/chat/completions", json=body, headers={"traceparent": traceparent})
    assert response.status_code == 200 and response.headers["traceparent"].split("-")[1] == trace_id
    usage = response.json()["usage"]
    named = by_name(otlp.wait_for(trace_id, {"POST /v1/chat/completions", "replica call", "replica chat"}))
    replica = named["replica chat"]
    assert replica.parent_span_id == named["replica call"].span_id
    assert replica.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert replica.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]


def test_a_refused_request_is_traced_with_its_status(base_url, otlp):
    traceparent, trace_id, client_span = client_context()
    response = httpx.post(
        base_url + "/v1/chat/completions",
        timeout=30,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": "Bearer sk-not-a-key", "traceparent": traceparent},
    )
    assert response.status_code == 401
    named = by_name(otlp.wait_for(trace_id, {"POST /v1/chat/completions", "edge"}))
    root = named["POST /v1/chat/completions"]  # and the edge's hop before it; no stage past the key
    assert root.parent_span_id == client_span and set(named) == {"POST /v1/chat/completions", "edge"}
    assert root.attributes["http.response.status_code"] == 401 and "sk-not-a-key" not in repr(root.attributes)


def test_without_a_traceparent_nothing_is_sampled_at_ratio_zero(http, otlp):
    response = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    assert response.status_code == 200
    unsampled = response.headers["traceparent"]
    assert int(unsampled.split("-")[3], 16) & 1 == 0  # a context to join, not recorded (W3C: bit 0 is sampled)
    # A sampled request sent after it is exported; the unsampled one never is.
    traceparent, trace_id, _ = client_context()
    http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"traceparent": traceparent},
    )
    # The marker: every process on the path exports its spans in the order they ended,
    # so once the later request's spans are in, the earlier one's would be.
    otlp.wait_for(trace_id, {"POST /v1/chat/completions", "replica chat", "llm_request"})
    assert not otlp.trace(unsampled.split("-")[1])
