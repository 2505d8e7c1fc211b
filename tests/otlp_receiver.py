"""An OTLP/HTTP traces receiver for tests: what an OpenTelemetry collector does
with `POST /v1/traces`, decoded with the official protobufs
(``opentelemetry-proto``), the spans kept in memory for assertions."""

from __future__ import annotations

import contextlib
import gzip
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from ports import free_port


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the exporting process' service.name
    name: str
    trace_id: str  # hex, as W3C traceparent writes it
    span_id: str
    parent_span_id: str  # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    events: dict[str, int]  # name -> time (ns)

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class OtlpReceiver:
    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._keep(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_):
                pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"

    def _keep(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            attributes = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = attributes.get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(
                        ReceivedSpan(
                            service,
                            span.name,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            span.kind,
                            span.start_time_unix_nano,
                            span.end_time_unix_nano,
                            {a.key: _value(a.value) for a in span.attributes},
                            {e.name: e.time_unix_nano for e in span.events},
                        )
                    )
        with self._lock:
            self.spans.extend(found)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 30) -> list[ReceivedSpan]:
        """The trace's spans once every one of ``names`` came (exporters batch: every 0.5 s here)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if names <= {span.name for span in spans}:
                return spans
            assert time.monotonic() < deadline, (names - {span.name for span in spans}, spans)
            time.sleep(0.2)


@contextlib.contextmanager
def running_otlp_receiver():
    receiver = OtlpReceiver()
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()
