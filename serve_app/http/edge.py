"""What the ingress refuses before any route runs.

Ray Serve reads two request headers as instructions to itself:
``x-request-disconnect-disabled: ?1`` (keep the request running after the
client has gone) and ``x-request-timeout-seconds`` (its own end-to-end
timeout, or none). They are for services calling Serve, not for a tenant: a
client setting them could keep generation (and its slot) busy after hanging
up. Serve has acted on them by the time the ingress sees the request, so the
ingress refuses the request outright, before it reaches a model.
"""

from __future__ import annotations

from serve_app.errors import OpenAIError

# ray.serve._private.constants: SERVE_HTTP_REQUEST_{DISCONNECT_DISABLED,TIMEOUT_S}_HEADER
SERVE_CONTROL_HEADERS = frozenset({b"x-request-disconnect-disabled", b"x-request-timeout-seconds"})


class RefuseServeControlHeaders:
    """Pure ASGI middleware (no per-request task or body wrapping: streams pass untouched)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            for name, _ in scope["headers"]:  # ASGI lowercases header names
                if name in SERVE_CONTROL_HEADERS:
                    refusal = OpenAIError(
                        400,
                        f"The '{name.decode()}' header is reserved for the serving layer.",
                        param=name.decode(),
                        code="header_not_allowed",
                    )
                    await refusal.response()(scope, receive, send)
                    return
        await self.app(scope, receive, send)
