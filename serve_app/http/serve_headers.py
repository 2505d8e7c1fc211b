"""What the ingress refuses before any route runs.

Ray Serve reads request headers as instructions to itself:
``x-request-disconnect-disabled: ?1`` (keep the request running after the
client has gone), ``x-request-timeout-seconds`` (its own end-to-end timeout, or
none) and ``serve_multiplexed_model_id`` (in any case, with ``-`` for ``_``: which
LoRA adapter a replica runs, in place of the one the key was authorized for).
They are for services calling Serve, not for a tenant: a client setting them
could keep generation (and its slot) busy after hanging up, or run an adapter it
named around its key. Serve has acted on them by the time the ingress (or a
model's direct route) sees the request, so the request is refused outright,
before it reaches a model. (``x-serve-router-*`` Ray's HAProxy strips itself; the
session header ``x-session-id`` is the client's, read by the gateway.) The names
are Ray's constants, checked against them: tests/unit/test_serve_headers.py.
"""

from __future__ import annotations

from serve_app.errors import OpenAIError

# ray.serve._private.constants: SERVE_HTTP_REQUEST_{DISCONNECT_DISABLED,TIMEOUT_S}_HEADER and
# SERVE_MULTIPLEXED_MODEL_ID, each as Serve matches it (lowercase, '-' read as '_').
SERVE_CONTROL_HEADERS = frozenset(
    {"x_request_disconnect_disabled", "x_request_timeout_seconds", "serve_multiplexed_model_id"}
)


def is_serve_control_header(name: bytes) -> bool:
    return name.decode("latin-1").lower().replace("-", "_") in SERVE_CONTROL_HEADERS


class RefuseServeControlHeaders:
    """Pure ASGI middleware (no per-request task or body wrapping: streams pass untouched)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            for name, _ in scope["headers"]:  # ASGI lowercases header names
                if is_serve_control_header(name):
                    refusal = OpenAIError(
                        400,
                        f"The '{name.decode()}' header is reserved for the serving layer.",
                        param=name.decode(),
                        code="header_not_allowed",
                    )
                    await refusal.response()(scope, receive, send)
                    return
        await self.app(scope, receive, send)
