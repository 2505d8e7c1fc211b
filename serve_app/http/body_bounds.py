"""Every request body any route reads is bounded in size and in time, by its route's
declaration (``Routes``: route_access.py), not by each handler remembering to check.

A route declares the kind of body it takes (``BodyKind``), or takes its method's
default: no body for GET and DELETE, a JSON request for POST and PATCH. Each route is a
``BoundedRoute``, which hands FastAPI (and so the handler, ``request.body()``,
``request.form()``, ``request.stream()``) a ``receive`` that counts the body's bytes and
stops at the kind's limit with a 413, and stops a body that has not arrived whole by
its deadline with a 408. Nothing reads a body around it: the ASGI app hands every route
its ``receive`` through it, and tests/unit/test_body_bounds.py checks that each route of
each app is one.

The limits are the deployment's settings (``BodyBounds``, put on the app's state when
the deployment starts): a JSON request ``ingress.max_body_bytes`` within
``ingress.body_timeout_s``; a console form 16 KiB within the same time; a file upload
``batch.max_file_bytes`` (and its form's fields) at no less than
``MIN_UPLOAD_BYTES_PER_S`` on top of the same time (a 200 MB upload: 26 minutes at most;
it holds one of its key's concurrency slots meanwhile). Before this, the console's login
read a 256 MiB form whole before its 413 (the ingress replica 189 → 435 MiB), and a body
sent a byte every 5 s stayed open past 100 s.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from fastapi.routing import APIRoute

from serve_app.errors import OpenAIError

BodyKind = Literal["none", "json", "form", "upload"]

# The console's forms: a few short fields (a name, a team, limits).
MAX_FORM_BYTES = 16 * 1024
# A body a route that takes none may still carry (a client's stray `{}`); no more is read.
MAX_UNEXPECTED_BYTES = 4 * 1024
# The slowest upload a route waits for, past ``body_timeout_s``.
MIN_UPLOAD_BYTES_PER_S = 128 * 1024
# An upload's form fields besides the file (``purpose``, the parts' headers).
UPLOAD_FORM_BYTES = 64 * 1024


@dataclass(frozen=True)
class BodyBounds:
    """The deployment's limits on bodies (its settings)."""

    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout_s: float = 60.0
    max_file_bytes: int = 200 * 1024 * 1024

    def limit(self, kind: BodyKind) -> tuple[int, float]:
        """(bytes, seconds) a body of ``kind`` may take to arrive whole."""
        if kind == "json":
            return self.max_body_bytes, self.body_timeout_s
        if kind == "form":
            return MAX_FORM_BYTES, self.body_timeout_s
        if kind == "upload":
            size = self.max_file_bytes + UPLOAD_FORM_BYTES
            return size, self.body_timeout_s + size / MIN_UPLOAD_BYTES_PER_S
        return MAX_UNEXPECTED_BYTES, self.body_timeout_s


DEFAULT_BOUNDS = BodyBounds()


def body_bounds_of(settings) -> BodyBounds:
    """The bounds an ``AppSettings`` sets."""
    return BodyBounds(settings.ingress.max_body_bytes, settings.ingress.body_timeout_s, settings.batch.max_file_bytes)


def default_kind(methods: set[str]) -> BodyKind:
    return "json" if methods & {"POST", "PUT", "PATCH"} else "none"


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"Request body exceeds {limit} bytes.", code="request_too_large")


def too_slow(timeout_s: float) -> OpenAIError:
    return OpenAIError(408, f"The request body did not arrive within {timeout_s:g}s.", code="request_timeout")


def bounded_receive(receive, limit: int, timeout_s: float, declared: int | None):
    """``receive`` that raises ``too_large`` once the body passes ``limit`` bytes (or
    declares more) and ``too_slow`` once it has not arrived whole ``timeout_s`` after the
    first read: the handler's read raises it, and the app answers it as any error."""
    loop = asyncio.get_running_loop()
    deadline: float | None = None
    received = 0
    done = False

    async def bounded():
        nonlocal deadline, received, done
        if done:  # the body is whole: what follows is the client's disconnect, unbounded
            return await receive()
        if declared is not None and declared > limit:
            raise too_large(limit)
        if deadline is None:
            deadline = loop.time() + timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            raise too_slow(timeout_s) from None
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise too_large(limit)
            done = not message.get("more_body", False)
        return message

    return bounded


class BoundedRoute(APIRoute):
    """A route whose body is read through ``bounded_receive`` (``body_kind``: its
    declaration; the limits: the app's ``state.body_bounds``)."""

    body_kind: BodyKind | None = None

    async def handle(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await super().handle(scope, receive, send)
        bounds: BodyBounds = getattr(scope["app"].state, "body_bounds", DEFAULT_BOUNDS)
        limit, timeout_s = bounds.limit(self.body_kind or default_kind(self.methods or set()))
        # Its 413 or 408 is raised by the read, wherever it is, and answered by the app's
        # handler of OpenAIError (request_handling.openai_app), as any error.
        await super().handle(scope, bounded_receive(receive, limit, timeout_s, _declared_length(scope)), send)


def bounded_route(kind: BodyKind | None) -> type[BoundedRoute]:
    """The route class of a route that declared ``kind`` (None: its method's default)."""
    return type(f"BoundedRoute_{kind or 'default'}", (BoundedRoute,), {"body_kind": kind})


def _declared_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None
