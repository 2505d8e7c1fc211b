"""The edge's own settings on Ray Serve's HAProxy config, which Ray does not expose.

Ray writes HAProxy's config from its template and starts ``haproxy -f <file>`` (again
on every reload) through ``llm-haproxy`` (``haproxy_guard.py``), which passes it
through ``edge_config`` first:

- ``timeout http-request`` (Ray leaves it unset): a client has this long to send a
  request's headers, so connections trickling a header line every few seconds (a
  slowloris; HAProxy's ``maxconn`` is 4,096) are closed with a 408 instead of locking
  every tenant out; ``timeout http-keep-alive``: how long an idle kept-alive
  connection is held between requests.
- ``EDGE_TIME_HEADER`` on every request a frontend forwards: when HAProxy had it, so
  a trace shows the hop from the edge to the ingress (an "edge" span: HAProxy 2.8 as
  Ray ships it is built without OpenTelemetry, ``-OT``).
- HAProxy's own answers in OpenAI's error envelope as JSON, with their real status
  (no replica up: 503 with ``Retry-After``; a replica gone: 502; too slow: 504), instead
  of Ray's plain-text "Internal Server Error" for all three. HAProxy 2.8 answers the
  errors it raises before a request is parsed (a 408 for headers too slow, a 400 for a
  request line past its buffer) with its own HTML whatever the config says (tried:
  ``errorfile`` and ``http-error`` in the defaults and in the frontend; its HTTP/1 mux,
  ``h1_send_error``, writes the built-in ``http_err_msgs`` and reads the configured
  error file only to see whether it is empty, which would close without an answer);
  their status is right, their body is not JSON.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from pathlib import Path

from contract.edge import EDGE_TIME_HEADER

REQUEST_HEADERS_TIMEOUT_S = 10
KEEP_ALIVE_TIMEOUT_S = 60

# The statuses HAProxy itself answers (those its `errorfile` takes), what each
# tells an OpenAI client, and OpenAI's error type and code for it.
EDGE_ERRORS = {
    400: ("The request could not be read (a malformed request, or a request line or headers too long).",
          "invalid_request_error", "bad_request"),
    403: ("The request was refused.", "permission_error", "forbidden"),
    405: ("Method not allowed.", "invalid_request_error", "method_not_allowed"),
    408: (f"The request was not sent within {REQUEST_HEADERS_TIMEOUT_S}s.", "invalid_request_error",
          "request_timeout"),
    413: ("The request is too large.", "invalid_request_error", "request_too_large"),
    429: ("Too many requests.", "rate_limit_error", "rate_limit_exceeded"),
    500: ("The server had an error processing your request.", "server_error", None),
    501: ("Not implemented.", "server_error", None),
    502: ("No replica of the service answered. Please retry.", "server_error", "bad_gateway"),
    503: ("The service has no replica ready. Please retry shortly.", "service_unavailable_error",
          "service_unavailable"),
    504: ("The service did not answer in time. Please retry.", "server_error", "gateway_timeout"),
}

_DEFAULTS = re.compile(r"^defaults[^\n]*\n", re.MULTILINE)
_FRONTEND = re.compile(r"^frontend[^\n]*\n", re.MULTILINE)
_OWN_SETTINGS = re.compile(r"^\s*(timeout http-request|timeout http-keep-alive|errorfile) .*\n", re.MULTILINE)


def error_response(status: int) -> bytes:
    """HAProxy's errorfile for ``status``: a whole HTTP response, OpenAI's envelope as JSON."""
    message, kind, code = EDGE_ERRORS[status]
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    headers = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "Content-Type: application/json",
               f"Content-Length: {len(body)}", "Cache-Control: no-cache", "Connection: close"]
    if status in (429, 503):
        headers.append("Retry-After: 1")
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + body


def edge_config(config: str, error_dir: Path) -> str:
    """``config`` (Ray's) with the edge's timeouts and JSON error files in every
    ``defaults`` section (replacing Ray's own of each) and the edge's time on every
    request of each ``frontend``; the error files are written to ``error_dir``."""
    error_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"    timeout http-request {REQUEST_HEADERS_TIMEOUT_S}s",
             f"    timeout http-keep-alive {KEEP_ALIVE_TIMEOUT_S}s"]
    for status in EDGE_ERRORS:
        path = error_dir / f"{status}.http"
        path.write_bytes(error_response(status))
        lines.append(f"    errorfile {status} {path}")
    own = "\n".join(lines) + "\n"
    stamp = f"    http-request set-header {EDGE_TIME_HEADER} %[date(0,us)]\n"  # first: before any rule answers
    sections = re.split(r"(?m)^(?=\S)", config)  # each section starts at an unindented line
    return "".join(
        _DEFAULTS.sub(lambda head: head.group(0) + own, _OWN_SETTINGS.sub("", section))
        if section.startswith("defaults")
        else _FRONTEND.sub(lambda head: head.group(0) + stamp, section) if section.startswith("frontend")
        else section
        for section in sections)


def rewrite_args(args: list[str]) -> list[str]:
    """haproxy's arguments with each ``-f <file>`` replaced by that file passed
    through ``edge_config`` (written beside it, as ``<file>.edge``)."""
    out = list(args)
    for i, arg in enumerate(args[:-1]):
        if arg == "-f":
            source = Path(args[i + 1])
            target = source.with_name(source.name + ".edge")
            target.write_text(edge_config(source.read_text(), source.parent / "edge-errors"))
            out[i + 1] = str(target)
    return out
