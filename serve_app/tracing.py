"""OpenTelemetry traces of requests at the ingress: one trace per request, a span
per stage the gateway goes through, exported over OTLP/HTTP (``telemetry.tracing``).

The root span opens when the request comes (continuing the client's W3C
``traceparent``, which the answer carries back); its context travels with the call
to the model's replica, whose span (replicas/tracing.py) is a child of the
gateway's "replica call" span. Stages are written as they end, from times taken
at their start, so no span object lives across an await but the root and the
replica call. Attributes follow OpenTelemetry's GenAI conventions (model, token
counts) plus the key id, team and tier; never the key's secret nor prompt text.

Off (no endpoint) a request carries ``None`` and pays one attribute check per
stage. The SDK reads its exporter and service name from the standard ``OTEL_*``
variables, which the application builders set on every deployment
(``TracingConfig.env``); the sampler is the gateway's own: a client's sampled flag
is followed, a request without one is sampled at ``sample_ratio``. Only the gateway
starts traces: every other tracer (the replica's, vLLM's) follows its parent."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from contract.edge import EDGE_TIME_HEADER
from contract.tracing import TRACES_SAMPLE_RATIO_ENV

_PROPAGATOR = TraceContextTextMapPropagator()
_UNSET = object()
_tracer: Any = _UNSET


def process_tracer() -> Tracer | None:
    """This process's tracer, made once from the ``OTEL_*`` variables; None when no
    traces endpoint is set."""
    global _tracer
    if _tracer is _UNSET:
        _tracer = None
        if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

            ratio = float(os.environ.get(TRACES_SAMPLE_RATIO_ENV, "1.0"))
            provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)))  # service name: environment
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            _tracer = provider.get_tracer("llm_cluster.gateway")
    return _tracer


def now_ns() -> int:
    return time.time_ns()


def replica_context(trace: RequestTrace | None, model: str) -> dict[str, str] | None:
    """What a call to ``model``'s replica carries of ``trace`` (None: not traced)."""
    return trace.replica_call(model) if trace is not None else None


class RequestTrace:
    """One request's spans at the ingress."""

    def __init__(self, tracer: Tracer, name: str, headers: Mapping[str, str]):
        self.tracer = tracer
        self.root = tracer.start_span(name, context=_PROPAGATOR.extract(headers), kind=SpanKind.SERVER)
        self.context = set_span_in_context(self.root)
        # Not sampled: the root's context still answers the client (and joins its
        # trace); no stage, no replica span is made.
        self.recording = self.root.is_recording()
        self.call: Span | None = None
        edge_ns = _edge_time_ns(headers, self.root)
        if edge_ns is not None:  # the hop from HAProxy to this ingress: until the request span began
            self.tracer.start_span("edge", context=self.context, start_time=edge_ns).end(self.root.start_time)  # type: ignore[attr-defined]  # an SDK span

    @classmethod
    def start(cls, name: str, headers: Mapping[str, str]) -> RequestTrace | None:
        tracer = process_tracer()
        return cls(tracer, name, headers) if tracer is not None else None

    def stage(self, name: str, started_ns: int, **attributes: Any) -> None:
        """A stage that began at ``started_ns`` and ends now."""
        if not self.recording:
            return
        span = self.tracer.start_span(
            name, context=self.context, start_time=started_ns, attributes=_attributes(attributes)
        )
        span.end()

    def replica_call(self, model: str) -> dict[str, str] | None:
        """Open the "replica call" span (once: an early start opens it before
        admission) and return its context for the replica, as W3C headers (None
        when not sampled)."""
        if not self.recording:
            return None
        if self.call is None:
            self.call = self.tracer.start_span(
                "replica call", context=self.context, kind=SpanKind.CLIENT, attributes={"gen_ai.request.model": model}
            )
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=set_span_in_context(self.call))
        return carrier

    def first_token(self) -> None:
        if self.call is not None:
            self.call.add_event("first token")

    def response_headers(self) -> dict[str, str]:
        """The trace's context for the client: the root span as its parent."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=self.context)
        return carrier

    def end(self, record: Any) -> None:
        """The request is over: its outcome on the root span (``record``: the
        ``telemetry.RequestRecord``), and the replica call closed."""
        if not self.recording:
            self.root.end()
            return
        attributes = _attributes(
            {
                "http.response.status_code": record.status,
                "gen_ai.operation.name": record.operation,
                "gen_ai.request.model": record.model,
                "gen_ai.usage.input_tokens": record.prompt_tokens,
                "gen_ai.usage.output_tokens": record.completion_tokens,
                "llm.request_id": record.request_id,  # the answer's x-request-id: the access log's request_id
                "llm.key.id": record.key_id,
                "llm.key.team": record.team,
                "llm.key.tier": record.tier,
                "llm.stream": record.stream,
                "llm.cancelled": record.cancelled,
                "llm.limit": record.limit,
                "error.type": record.error_code,
            }
        )
        if self.call is not None:
            self.call.set_attributes({k: v for k, v in attributes.items() if k.startswith("gen_ai.usage")})
            self.call.end()
        self.root.set_attributes(attributes)
        if record.status >= 500:
            self.root.set_status(Status(StatusCode.ERROR))
        self.root.end()


# The edge's time is believed within this much of the ingress' clock (HAProxy on
# another node: their clocks as NTP keeps them); outside it, or without HAProxy (a
# client could send the header), no edge span is made.
EDGE_SKEW_NS = 60 * 10**9


def _edge_time_ns(headers: Mapping[str, str], root: Span) -> int | None:
    """When HAProxy had the request (``contract.edge``), if the span is recorded and
    the time is plausible."""
    if not root.is_recording():
        return None
    raw = headers.get(EDGE_TIME_HEADER)
    if not raw or not raw.isascii() or not raw.isdigit() or len(raw) > 19:
        return None
    edge_ns = int(raw) * 1000
    started = root.start_time  # type: ignore[attr-defined]  # an SDK span (the API's has no start time)
    return edge_ns if started - EDGE_SKEW_NS <= edge_ns <= started else None


def _attributes(values: dict[str, Any]) -> dict[str, Any]:
    """OpenTelemetry takes no None values: unset ones are left out."""
    return {key: value for key, value in values.items() if value is not None and value != ""}
