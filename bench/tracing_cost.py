"""What traces cost the ingress per request, in CPU: the calls the gateway makes for
one streamed request (serve_app/tracing.py: the request span from the client's
headers, four stages, the replica call and its first-token event, the answer's
traceparent, the end with its attributes), run N times in this process, exported
over OTLP/HTTP (the SDK's batch processor and exporter, as deployed) to a sink that
keeps nothing. CPU time of the whole process (the export thread's protobuf and
HTTP work included), divided by N; medians of the repeats. Three modes: off (no
endpoint: what ships), unsampled (an endpoint, ratio 0), sampled (ratio 1).

A figure that the whole-stack bench (bench/gateway_capacity.py --targets shipped
traced-unsampled traced-all) cannot decide on this box: its per-target noise is
±10% of ~10 ms of ingress CPU per request.

    python bench/tracing_cost.py [--requests 5000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway_capacity import otlp_sink  # noqa: E402 - the same sink the whole-stack bench exports to

from serve_app.telemetry import RequestRecord  # noqa: E402

MODES = {"off": None, "unsampled": "0", "sampled": "1"}
STAGES = ("authenticate", "read body", "admission", "queue")


def one_request(tracing, headers) -> None:
    """What the gateway does for one streamed request (serve_app/http/request_handling.py,
    serve_app/pipeline/gateway.py, serve_app/telemetry.py)."""
    record = RequestRecord("openai", "req", trace=tracing.RequestTrace.start("POST /v1/chat/completions", headers))
    trace = record.trace
    if trace is not None:
        for stage in STAGES:
            trace.stage(stage, tracing.now_ns())
        trace.replica_call("tiny-llama")
        trace.first_token()
        trace.response_headers()
    record.status, record.model, record.operation, record.key_id = 200, "tiny-llama", "chat", "k1"
    record.prompt_tokens, record.completion_tokens, record.stream = 12, 64, True
    if trace is not None:
        trace.end(record)


def cpu_per_request(mode: str, endpoint: str, requests: int) -> float:
    """µs of process CPU per request in ``mode`` (a fresh tracer each time)."""
    import serve_app.tracing as tracing

    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"):
        os.environ.pop(name, None)
    if MODES[mode] is not None:
        os.environ.update(
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=endpoint,
            OTEL_TRACES_SAMPLER="parentbased_traceidratio",
            OTEL_TRACES_SAMPLER_ARG=MODES[mode],
        )
    tracing = importlib.reload(tracing)  # its process tracer, made again from the environment
    headers = {"authorization": "Bearer sk-x", "content-type": "application/json"}
    started = time.process_time()
    for _ in range(requests):
        one_request(tracing, headers)
    tracer = tracing.process_tracer()
    if tracer is not None:  # what the export thread still has to send counts too
        tracer.span_processor.force_flush()
    spent = time.process_time() - started
    if tracer is not None:
        tracer.span_processor.shutdown()  # its export thread ends
    return spent / requests * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    endpoint = otlp_sink()
    figures = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:  # interleaved: the box's drift falls on every mode alike
            figures[mode].append(cpu_per_request(mode, endpoint, args.requests))
    print(f"\nTraces' CPU per request at the ingress: {args.requests} requests × {args.repeats} repeats, medians\n")
    print("| mode | µs per request | repeats (µs) |\n|---|---|---|")
    for mode, values in figures.items():
        print(f"| {mode} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
