"""What every HTTP front of the gateway shares: the FastAPI app with OpenAI's
error envelope, and reading, admitting and answering one inference request.

Two deployments serve HTTP with it: the ingress (every route, every model) and,
for a model with ``direct_route``, the model's own replicas (its inference
routes only, the gateway in-process: ``serve_app/http/direct.py``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse

from contract.edge import EDGE_REQUEST_HEADER, EDGE_TIME_HEADER, session_header
from serve_app.accounting.usage import edge_request_tag
from serve_app.errors import OpenAIError, envelope, error_response, error_type_for
from serve_app.http.serve_headers import RefuseServeControlHeaders
from serve_app.identity.authentication import Authenticator
from serve_app.identity.keys import KeyRecord
from serve_app.pipeline.gateway import Gateway
from serve_app.telemetry import RequestRecord, Telemetry
from serve_app.tracing import RequestTrace, now_ns
from serve_app.wire.api_requests import parse_json_object
from serve_app.wire.calls import Call

# What a client's own body can be refused for before its admission (a 429 is a quota's).
CLIENT_MISTAKES = frozenset((400, 403, 404, 408, 413, 415, 422))

# The header naming a request's session (Ray's RAY_SERVE_SESSION_ID_HEADER_KEY, else x-session-id).
SESSION_HEADER = session_header()
logger = logging.getLogger("ray.serve")


def openai_app(title: str) -> FastAPI:
    """A FastAPI app answering every error in OpenAI's envelope, with no
    unauthenticated schema and the serving layer's control headers refused."""
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RefuseServeControlHeaders)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        # Unknown routes and wrong methods, in the same envelope as everything else.
        code = "unknown_url" if exc.status_code == 404 else None
        body = envelope(str(exc.detail), error_type_for(exc.status_code), code=code)
        return error_response(exc.status_code, body, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s", title)
        return error_response(500, envelope("The server had an error processing your request.", "server_error"))

    return app


def as_call(operation: str):
    """The translation of a route whose body is already the canonical request."""

    async def as_is(body: dict[str, Any], key: KeyRecord) -> Call:
        return Call(operation, body)

    return as_is


def serve_request_id(request: Request) -> str:
    """Ray Serve's id for this HTTP request: its proxy answers with it as x-request-id."""
    return request.headers.get("x-request-id", "")


def _span_name(request: Request) -> str:
    """The route as declared (``/v1/chat/completions``, ``/openai/deployments/{deployment}/…``),
    not the path a client sent: span names stay few."""
    route = request.scope.get("route")
    return f"{request.method} {getattr(route, 'path', request.url.path)}"


class HandlesRequests:
    """Reading and answering inference requests; the class using it sets
    ``authenticator``, ``gateway``, ``telemetry`` and ``room_check_bytes``."""

    authenticator: Authenticator
    gateway: Gateway
    telemetry: Telemetry
    room_check_bytes: int

    async def _read_body(self, request: Request) -> bytes:
        """The body, as its route's declaration bounds it (http/body_bounds.py): every
        route is a ``BoundedRoute``, whose ``receive`` answers a body past its size with a
        413 as soon as it passes it (a chunked upload declares no length) and one not
        whole within its time with a 408, wherever it is read."""
        return await request.body()

    async def _read(self, request: Request, record: RequestRecord) -> tuple[KeyRecord, dict[str, Any], int]:
        """The caller's key (checked first: no key, no parsing) and the JSON body. A body
        past ``room_check_bytes`` (or of no declared length) is read only once the key's
        requests/min and concurrency have room for it (``Gateway.refuse_before_body``)."""
        started = now_ns()
        seen: dict[str, str] = {}
        key = await self.authenticator.authenticate(request.headers, seen)
        record.for_key(key)
        if record.trace is not None:
            record.trace.stage("authenticate", started, **{"llm.auth.source": seen.get("source")})
            started = now_ns()
        declared = request.headers.get("content-length", "")
        large = not declared.isdigit() or int(declared) > self.room_check_bytes
        if large:
            await self.gateway.refuse_before_body(key)
        try:
            raw = await self._read_body(request)
            body = parse_json_object(raw)
        except OpenAIError:
            if large:  # read (or read at) before it was refused: a request of its key
                await asyncio.shield(self.gateway.count_refused_read(key))
            raise
        if record.trace is not None:
            record.trace.stage("read body", started, **{"http.request.body.size": len(raw)})
        return key, body, len(raw)

    async def _handle(self, route: str, request: Request, translate, on_error=None) -> Response:
        """One inference request by any route: read it, let ``translate`` turn
        the body into a ``Call`` of this route's dialect, run it, answer; every
        outcome is recorded once (access log + metrics, ``serve_app/telemetry.py``).
        ``on_error`` renders errors in the dialect's shape."""
        record = RequestRecord(
            route,
            serve_request_id(request),
            edge_tag=edge_request_tag(request.headers.get(EDGE_REQUEST_HEADER), request.headers.get(EDGE_TIME_HEADER)),
            trace=RequestTrace.start(_span_name(request), request.headers),
        )
        try:
            key, body, size = await self._read(request, record)
            try:
                call = await translate(body, key)
            except OpenAIError as exc:
                await self._count_refused(key, size, record, exc)
                raise
            try:
                reply = await self.gateway.run(
                    key,
                    call.operation,
                    call.body,
                    size + call.bytes_once_admitted,
                    record,
                    once_admitted=call.once_admitted,
                    session=request.headers.get(SESSION_HEADER),
                )
            except OpenAIError as exc:
                if call.abandon is not None:
                    await asyncio.shield(call.abandon())
                await self._count_refused(key, size, record, exc)
                raise
            except BaseException:
                if call.abandon is not None:
                    await asyncio.shield(call.abandon())
                raise
            response = call.respond(reply)
            if inspect.isawaitable(response):  # a respond that keeps state (Responses API)
                response = await response
        except OpenAIError as exc:
            record.refused(exc.status, exc.code, exc.type, exc.headers)
            response = on_error(exc) if on_error else exc.response()
        except BaseException as exc:
            record.status = 499 if isinstance(exc, asyncio.CancelledError) else 500  # 499: client closed
            self.telemetry.finish(record)
            raise
        if record.trace is not None:
            response.headers.update(record.trace.response_headers())
        if not (record.stream and isinstance(response, StreamingResponse)):  # a stream finishes at its end
            record.status = response.status_code
            self.telemetry.finish(record)
        return response

    async def _count_refused(self, key: KeyRecord, size: int, record: RequestRecord, exc: OpenAIError) -> None:
        """A body past the room check refused for the client's own mistake before its
        admission counts as a request (``Gateway.count_refused_read``); an admitted one
        was counted by its admission, a quota's 429 as a refusal, and a 5xx is ours."""
        if size > self.room_check_bytes and record.admitted_at is None and exc.status in CLIENT_MISTAKES:
            await asyncio.shield(self.gateway.count_refused_read(key))

    async def _openai(self, operation: str, request: Request) -> Response:
        return await self._handle("openai", request, as_call(operation))
