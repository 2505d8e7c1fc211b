"""The ingress deployment: OpenAI's HTTP API in front of the model replicas.

It parses just enough of each request to route it (``chat_request``), sends it
to the model's replica deployment through a ``DeploymentHandle`` and relays the
answer: JSON as one body, streams chunk by chunk. It holds no model state.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from serve_app.access import Access, Ticket
from serve_app import admin
from serve_app.chat_request import ChatEnvelope, parse_chat_request, parse_json_object
from serve_app.errors import OpenAIError, envelope, error_response, error_type_for, from_engine_error
from serve_app.settings import AppSettings
from serve_app.sse import DONE, split_replica, take_usage

logger = logging.getLogger("ray.serve")

app = FastAPI(title="llm-cluster", docs_url=None, redoc_url=None)


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
    logger.exception("unhandled error in ingress")
    return error_response(500, envelope("The server had an error processing your request.", "server_error"))


async def _relay(first: str, chunks, access: Access, ticket: Ticket, client_wants_usage: bool):
    """Relay the replica's stream and account for it.

    The usage event (always requested from the replica) is read from the final
    item and hidden unless the client asked for it. If the client goes away,
    cancel downstream (Serve cancels the replica's generator, vLLM aborts)."""
    status, usage = "cancelled", None
    replica, first = split_replica(first)
    try:
        if first.endswith(DONE):
            first, usage = take_usage(first, client_wants_usage)
        yield first
        access.running(ticket, replica)
        async for chunk in chunks:
            if chunk.endswith(DONE):
                chunk, usage = take_usage(chunk, client_wants_usage)
            yield chunk
        status = "completed"
    except Exception:
        status = "failed"
        logger.exception("stream from replica failed")
        yield 'data: {"error": {"message": "The model stream failed.", "type": "server_error", "param": null, "code": null}}\n\n'
    finally:
        if status != "completed":
            chunks.cancel()
        # A cancelled stream's usage is unknown: its reservation stays charged.
        access.settle(ticket, status, usage if status == "completed" else None, replica)


@serve.deployment
@serve.ingress(app)
class Ingress:
    def __init__(self, settings: AppSettings, models: dict[str, DeploymentHandle]):
        self.settings = settings
        self.max_body_bytes = settings.ingress.max_body_bytes
        self.models = models
        self.access = Access(settings)
        created = int(time.time())
        self.model_cards = {
            name: {"id": name, "object": "model", "created": created, "owned_by": "llm-cluster"}
            for name in models
        }

    def _handle(self, model: str) -> DeploymentHandle:
        handle = self.models.get(model)
        if handle is None:
            raise OpenAIError(
                404,
                f"The model '{model}' does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        return handle

    async def _read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise OpenAIError(413, f"Request body exceeds {self.max_body_bytes} bytes.")
        raw = await request.body()
        if len(raw) > self.max_body_bytes:
            raise OpenAIError(413, f"Request body exceeds {self.max_body_bytes} bytes.")
        return raw

    # -- OpenAI API ---------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        key = await self.access.authenticate(request.headers)
        raw = await self._read_body(request)
        body, chat = parse_chat_request(raw)
        handle = self._handle(chat.model)
        self.access.authorize(key, chat.model)
        ticket = await self.access.admit(
            key,
            chat.model,
            self.access.reserve_tokens(body, len(raw)),
            # Ray Serve's id for this HTTP request: it answers it as x-request-id.
            request.headers.get("x-request-id", ""),
        )
        body["request_id"] = ticket.request_id
        try:
            if chat.stream:
                return await self._stream(handle, body, chat, ticket)
            status, payload, usage, replica = await handle.chat.remote(body)
        except OpenAIError as exc:
            exc.headers = {**ticket.headers, **exc.headers}
            raise
        except BaseException:
            self.access.settle(ticket, "failed")
            raise
        self.access.settle(ticket, "completed" if status == 200 else "failed", usage or {}, replica)
        if status != 200:
            error = from_engine_error(status, payload)
            error.headers = ticket.headers
            raise error
        return Response(payload, media_type="application/json", headers=ticket.headers)

    async def _stream(self, handle: DeploymentHandle, body: dict, chat: ChatEnvelope, ticket: Ticket) -> Response:
        client_wants_usage = bool(chat.stream_options and chat.stream_options.include_usage)
        # Usage is always asked for: it settles the token reservation.
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        chunks = handle.options(stream=True).chat_stream.remote(body)
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            self.access.settle(ticket, "failed")
            raise OpenAIError(500, "The model returned an empty stream.") from None
        if isinstance(first, tuple):
            status, error = first
            self.access.settle(ticket, "failed", {})
            raise from_engine_error(status, error)
        return StreamingResponse(
            _relay(first, chunks, self.access, ticket, client_wants_usage),
            media_type="text/event-stream",
            headers=ticket.headers,
        )

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> JSONResponse:
        key = await self.access.authenticate(request.headers)
        cards = [card for name, card in self.model_cards.items() if key.allows_model(name)]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(self, model_id: str, request: Request) -> JSONResponse:
        key = await self.access.authenticate(request.headers)
        self._handle(model_id)
        self.access.authorize(key, model_id)
        return JSONResponse(self.model_cards[model_id])

    # -- admin API (same operations as `llmctl`) ---------------------------------

    async def _admin_json(self, request: Request) -> Any:
        self.access.check_admin(request.headers)
        raw = await self._read_body(request)
        return parse_json_object(raw) if raw else {}

    @app.post("/admin/keys")
    async def admin_create_key(self, request: Request) -> JSONResponse:
        return JSONResponse(await admin.create_key(self.access, await self._admin_json(request)), status_code=201)

    @app.get("/admin/keys")
    async def admin_list_keys(self, request: Request) -> JSONResponse:
        self.access.check_admin(request.headers)
        return JSONResponse(await admin.list_keys(self.access))

    @app.get("/admin/keys/{key}")
    async def admin_show_key(self, key: str, request: Request) -> JSONResponse:
        self.access.check_admin(request.headers)
        return JSONResponse(await admin.show_key(self.access, key))

    @app.patch("/admin/keys/{key}")
    async def admin_update_key(self, key: str, request: Request) -> JSONResponse:
        return JSONResponse(await admin.update_key(self.access, key, await self._admin_json(request)))

    @app.delete("/admin/keys/{key}")
    async def admin_revoke_key(self, key: str, request: Request) -> JSONResponse:
        self.access.check_admin(request.headers)
        return JSONResponse(await admin.revoke_key(self.access, key))

    @app.get("/admin/keys/{key}/usage")
    async def admin_key_usage(self, key: str, request: Request) -> JSONResponse:
        self.access.check_admin(request.headers)
        return JSONResponse(await admin.usage(self.access, key))

    @app.get("/admin/requests/{request_id}")
    async def admin_request(self, request_id: str, request: Request) -> JSONResponse:
        self.access.check_admin(request.headers)
        return JSONResponse(await admin.request(self.access, request_id))

    @app.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok", "models": list(self.models)})
