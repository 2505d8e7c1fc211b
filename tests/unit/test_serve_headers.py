"""The request headers Ray Serve reads as instructions to itself are refused before any
route runs (serve_app/http/serve_headers.py): the list is Ray's own constants, so a Ray upgrade
that renames one fails here rather than letting it through."""

from __future__ import annotations

import asyncio

import pytest
from ray.serve._private import constants

from serve_app.http.serve_headers import SERVE_CONTROL_HEADERS, RefuseServeControlHeaders, is_serve_control_header


def as_serve_matches(name: str) -> str:
    return name.lower().replace("-", "_")


def test_the_refused_headers_are_rays_own_control_headers():
    rays = {
        as_serve_matches(constants.SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER),
        as_serve_matches(constants.SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER),
        as_serve_matches(constants.SERVE_MULTIPLEXED_MODEL_ID),
    }
    assert rays == SERVE_CONTROL_HEADERS
    # The session header is the client's (read by the gateway); Ray's HAProxy strips its router's.
    assert as_serve_matches(constants.SERVE_SESSION_ID) not in SERVE_CONTROL_HEADERS
    assert constants.SERVE_INGRESS_ROUTER_HEADER_PREFIX == "x-serve-router-"


@pytest.mark.parametrize(
    "name, refused",
    [
        (b"serve_multiplexed_model_id", True),
        (b"serve-multiplexed-model-id", True),
        (b"SERVE-Multiplexed_Model-ID", True),
        (b"x-request-timeout-seconds", True),
        (b"x_request_timeout_seconds", True),
        (b"x-request-disconnect-disabled", True),
        (b"x-session-id", False),
        (b"x-request-id", False),
        (b"authorization", False),
        (b"\xff\xfe", False),
    ],
)
def test_each_spelling_serve_matches_is_refused(name, refused):
    assert is_serve_control_header(name) is refused
    answered = []

    async def app(scope, receive, send):
        answered.append("app")

    async def send(message):
        if message["type"] == "http.response.start":
            answered.append(message["status"])

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [(name.lower(), b"x")]}
    asyncio.run(RefuseServeControlHeaders(app)(scope, receive, send))
    assert answered == ([400] if refused else ["app"])
