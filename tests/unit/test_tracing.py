"""Pure logic of a request's spans at the ingress (serve_app/tracing.py), with the
OpenTelemetry SDK's in-memory exporter: the client's context continued, stages as
children of the request span, nothing recorded when not sampled, no None
attribute. The whole path, across processes, is tests/e2e/shared_stack/test_tracing_e2e.py."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

from serve_app.telemetry import RequestRecord
from serve_app.tracing import RequestTrace, now_ns

CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def tracer(sampler=None):
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler) if sampler else TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def finished_record() -> RequestRecord:
    record = RequestRecord("openai", "r1")
    record.status, record.model, record.operation, record.key_id = 200, "tiny-llama", "chat", "k1"
    return record


def test_the_request_span_continues_the_clients_trace_and_holds_the_stages():
    otel, exporter = tracer()
    trace = RequestTrace(otel, "POST /v1/chat/completions", {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    trace.stage("authenticate", now_ns())
    carrier = trace.replica_call("tiny-llama")
    trace.first_token()
    answered = trace.response_headers()["traceparent"]
    trace.end(finished_record())
    spans = {span.name: span for span in exporter.get_finished_spans()}
    root = spans["POST /v1/chat/completions"]
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE and format(root.parent.span_id, "016x") == CLIENT_SPAN
    for name in ("authenticate", "replica call"):
        assert spans[name].parent.span_id == root.context.span_id
    # The replica's parent is the replica call; the client's is the request span.
    assert carrier["traceparent"].split("-")[2] == format(spans["replica call"].context.span_id, "016x")
    assert answered.split("-")[2] == format(root.context.span_id, "016x")
    assert [event.name for event in spans["replica call"].events] == ["first token"]
    assert root.attributes["gen_ai.request.model"] == "tiny-llama"
    assert "error.type" not in root.attributes and "llm.key.team" not in root.attributes  # None/"" left out


def test_an_unsampled_request_records_nothing_but_answers_a_context():
    otel, exporter = tracer(ParentBased(ALWAYS_OFF))
    trace = RequestTrace(otel, "POST /v1/chat/completions", {})
    trace.stage("authenticate", now_ns())
    assert trace.replica_call("tiny-llama") is None  # the replica makes no span either
    flags = trace.response_headers()["traceparent"].split("-")[3]
    trace.end(finished_record())
    assert exporter.get_finished_spans() == () and int(flags, 16) & 1 == 0


def test_a_clients_sampled_flag_wins_over_a_zero_ratio():
    otel, exporter = tracer(ParentBased(ALWAYS_OFF))
    trace = RequestTrace(otel, "POST /v1/embeddings", {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    trace.stage("read body", now_ns())
    trace.end(finished_record())
    assert {span.name for span in exporter.get_finished_spans()} == {"read body", "POST /v1/embeddings"}


def test_off_without_an_endpoint(monkeypatch):
    import serve_app.tracing as tracing

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setattr(tracing, "_tracer", tracing._UNSET)
    assert RequestTrace.start("POST /v1/chat/completions", {}) is None


def test_vllm_is_handed_the_replica_spans_context_as_a_requests_trace_headers():
    from replicas.tracing import engine_request

    provider = TracerProvider()
    span = provider.get_tracer("t").start_span("replica chat")
    request = engine_request(span)
    context = span.get_span_context()
    version, trace_id, span_id, flags = request.headers["traceparent"].split("-")
    assert (trace_id, span_id) == (f"{context.trace_id:032x}", f"{context.span_id:016x}")
    assert int(flags, 16) & 1  # sampled: vLLM's engine records its span
    assert request.headers.get("X-Request-Id") is None  # vLLM reads nothing else from it but sets its state
    request.state.request_metadata = "set by vLLM"
    assert engine_request(None) is None  # an untraced call: vLLM gets no request, as before


def test_the_hop_from_the_edge_is_a_span_from_haproxys_time_to_the_request_span():
    import time

    otel, exporter = tracer()
    parent = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    edge_us = time.time_ns() // 1000 - 3000  # HAProxy had it 3 ms ago
    trace = RequestTrace(otel, "POST /v1/chat/completions", {**parent, "x-llm-edge-us": str(edge_us)})
    trace.end(finished_record())
    spans = {span.name: span for span in exporter.get_finished_spans()}
    edge, root = spans["edge"], spans["POST /v1/chat/completions"]
    assert edge.parent.span_id == root.context.span_id
    assert edge.start_time == edge_us * 1000 and edge.end_time == root.start_time
    # Implausible values (no HAProxy in front: a client sent it; clocks far apart) make no span.
    for value in ("", "12x", "9" * 30, str(edge_us - 120 * 10**6), str(time.time_ns() // 1000 + 10**6)):
        otel, exporter = tracer()
        RequestTrace(otel, "POST /v1/chat/completions", {**parent, "x-llm-edge-us": value}).end(finished_record())
        assert [span.name for span in exporter.get_finished_spans()] == ["POST /v1/chat/completions"], value
