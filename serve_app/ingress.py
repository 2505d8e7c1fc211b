"""The ingress deployment: OpenAI's HTTP API in front of the model replicas.

It parses just enough of each request to route it (``chat_request``), sends it
to the model's replica deployment through a ``DeploymentHandle`` and relays the
answer: JSON as one body, streams chunk by chunk. It holds no model state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from serve_app.chat_request import parse_chat_request
from serve_app.errors import OpenAIError, envelope, error_response, error_type_for, from_engine_error
from serve_app.settings import AppSettings

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


async def _relay(first: str, chunks) -> AsyncIterator[str]:
    """Relay the replica's stream; if the client goes away, cancel it downstream
    (Serve cancels the replica's generator, vLLM aborts the request)."""
    finished = False
    try:
        yield first
        async for chunk in chunks:
            yield chunk
        finished = True
    except Exception:
        logger.exception("stream from replica failed")
        yield 'data: {"error": {"message": "The model stream failed.", "type": "server_error", "param": null, "code": null}}\n\n'
    finally:
        if not finished:
            chunks.cancel()


@serve.deployment
@serve.ingress(app)
class Ingress:
    def __init__(self, settings: AppSettings, models: dict[str, DeploymentHandle]):
        self.settings = settings
        self.max_body_bytes = settings.ingress.max_body_bytes
        self.models = models
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
        body, chat = parse_chat_request(await self._read_body(request))
        handle = self._handle(chat.model)
        if chat.stream:
            return await self._stream(handle, body)
        status, payload = await handle.chat.remote(body)
        if status != 200:
            raise from_engine_error(status, payload)
        return Response(payload, media_type="application/json")

    async def _stream(self, handle: DeploymentHandle, body: dict) -> Response:
        chunks = handle.options(stream=True).chat_stream.remote(body)
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            raise OpenAIError(500, "The model returned an empty stream.") from None
        if isinstance(first, tuple):
            status, error = first
            raise from_engine_error(status, error)
        return StreamingResponse(_relay(first, chunks), media_type="text/event-stream")

    @app.get("/v1/models")
    async def list_models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": list(self.model_cards.values())})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(self, model_id: str) -> JSONResponse:
        self._handle(model_id)
        return JSONResponse(self.model_cards[model_id])

    @app.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok", "models": list(self.models)})
