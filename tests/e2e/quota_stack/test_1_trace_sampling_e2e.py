"""Who decides what is traced, on the real stack (the package's stack exports to a
receiver this test runs at a sample ratio of 0.5; /v1 chat takes the model's direct
route, as shipped: the gateway runs in the model's replica): the gateway, once per
request, and every process after it follows that decision. vLLM's engine builds its tracer
from the environment: it must record its ``llm_request`` span only under the
replica's sampled span, never start a trace of its own for a request the gateway
did not sample (an orphan engine trace, which vLLM's own ratio sampler made before).

- Requests without a traceparent: each answer's traceparent says whether the
  gateway sampled it; a sampled one's trace holds the request span and the engine's
  span under the replica's, an unsampled one left no span anywhere.
- A client's traceparent is followed both ways: flag 01 traced to the engine,
  flag 00 never, whatever the ratio.
- No engine span anywhere in the receiver (every module of the package sent
  traffic to it) lacks its parent."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest
from stack import create_key

from quota_stack.stack_args import MODEL

pytestmark = pytest.mark.e2e

HELLO = [{"role": "user", "content": "hi"}]
REQUEST_SPAN = "POST /v1/chat/completions"
ENGINE_SPAN = "llm_request"


def sampled(traceparent: str) -> bool:
    return int(traceparent.split("-")[3], 16) & 1 == 1  # W3C: bit 0 of the flags


@pytest.fixture(scope="module")
def http(base_url, redis_server):
    _, secret = create_key(redis_server.url, "trace-sampling")
    with httpx.Client(base_url=base_url, headers={"authorization": f"Bearer {secret}"}, timeout=120) as client:
        yield client


def chat(http, traceparent: str | None = None) -> str:
    """The trace id of one chat request's answer, after checking it was served."""
    headers = {"traceparent": traceparent} if traceparent else {}
    response = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 2}, headers=headers
    )
    assert response.status_code == 200, response.text
    return response.headers["traceparent"]


def engine_parent(otlp, trace_id: str, timeout_s: float = 30):
    """The span the trace's engine span is a child of, once both came (each process
    exports its own batches: the engine's may come before the replica's)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = otlp.wait_for(trace_id, {REQUEST_SPAN, ENGINE_SPAN}, timeout_s)
        [engine] = [span for span in spans if span.name == ENGINE_SPAN]
        parents = [span for span in spans if span.span_id == engine.parent_span_id]
        if parents:
            return parents[0]
        assert time.monotonic() < deadline, (engine, spans)
        time.sleep(0.2)


def flushed(http, otlp) -> None:
    """Until every span of the requests answered so far has reached the receiver: a
    sampled marker sent after them, waited for. Each process on the path (the model's
    replica, behind its direct route; its engine) exports its spans in the order they
    ended, so the marker's arriving means theirs would have: "nothing arrived" is read
    after a positive signal, never after a fixed sleep a slow exporter could outlast."""
    trace_id = secrets.token_hex(16)
    assert chat(http, f"00-{trace_id}-{secrets.token_hex(8)}-01").split("-")[1] == trace_id
    engine_parent(otlp, trace_id)


def orphan_engine_spans(otlp) -> list:
    with otlp._lock:
        spans = list(otlp.spans)
    ids = {(span.trace_id, span.span_id) for span in spans}
    return [span for span in spans if span.name == ENGINE_SPAN and (span.trace_id, span.parent_span_id) not in ids]


def test_the_gateways_sampling_decision_holds_in_the_engine(http, otlp):
    answers = [chat(http) for _ in range(24)]
    kept = [answer.split("-")[1] for answer in answers if sampled(answer)]
    dropped = [answer.split("-")[1] for answer in answers if not sampled(answer)]
    assert kept and dropped, answers  # at 0.5, all 24 one way: once in 8 million runs
    for trace_id in kept:
        assert engine_parent(otlp, trace_id).name.startswith("replica ")
    flushed(http, otlp)
    for trace_id in dropped:
        assert not otlp.trace(trace_id), otlp.trace(trace_id)
    assert not orphan_engine_spans(otlp)


def test_a_clients_sampled_flag_is_followed_to_the_engine_both_ways(http, otlp):
    trace_ids = {flag: secrets.token_hex(16) for flag in ("00", "01")}
    for flag, trace_id in trace_ids.items():
        answer = chat(http, f"00-{trace_id}-{secrets.token_hex(8)}-{flag}")
        assert answer.split("-")[1] == trace_id and sampled(answer) == (flag == "01")
    assert engine_parent(otlp, trace_ids["01"]).name.startswith("replica ")
    flushed(http, otlp)
    assert not otlp.trace(trace_ids["00"])
    assert not orphan_engine_spans(otlp)
