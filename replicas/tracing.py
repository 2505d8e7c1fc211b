"""A replica's span of each call it runs, a child of the gateway's "replica call"
span (serve_app/tracing.py) through the W3C context the call carries: the time
from the replica taking the call to the engine's first output ("first token"
event: the engine's queue and prefill) and to its end (decode and the relay to
the ingress). Exported as the ingress's spans are, configured by the same
``OTEL_*`` variables (set on every deployment when ``telemetry.tracing`` names an
endpoint); with none set, a call pays one dictionary check."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_UNSET = object()
_tracer: Any = _UNSET


def _process_tracer() -> Tracer | None:
    global _tracer
    if _tracer is _UNSET:
        _tracer = None
        if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            # Sampler (parentbased_always_off: a span only under the gateway's sampled
            # one) and service name from the environment (TracingConfig.env).
            provider = TracerProvider()
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            _tracer = provider.get_tracer("llm_cluster.replica")
    return _tracer


def call_span(trace: dict[str, str] | None, operation: str, model: str, replica: str) -> Span | None:
    """The span of one call, started; None when the call carries no context or
    traces are off. The caller ends it (``end_span``)."""
    tracer = _process_tracer() if trace else None
    if tracer is None:
        return None
    return tracer.start_span(
        f"replica {operation}",
        context=_PROPAGATOR.extract(trace),
        kind=SpanKind.SERVER,
        attributes={"gen_ai.operation.name": operation, "gen_ai.request.model": model, "llm.replica": replica},
    )


def engine_request(span: Span | None) -> Any:
    """What vLLM's serving layer reads trace headers from (its ``raw_request``),
    carrying ``span``'s context: vLLM's engine then records its own span of the
    request (``llm_request``: time in queue, prefill, decode, time to first token,
    tokens) as the replica span's child. None without a span. vLLM's serving layer
    reads a request's ``headers`` and sets its ``state``, nothing else."""
    if span is None:
        return None
    from opentelemetry.trace import set_span_in_context
    from starlette.datastructures import Headers, State

    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=set_span_in_context(span))
    return SimpleNamespace(headers=Headers(carrier), state=State())


def end_span(span: Span | None) -> None:
    if span is not None:
        span.end()
