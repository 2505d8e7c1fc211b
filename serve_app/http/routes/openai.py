"""OpenAI's inference API and the models it lists, and vLLM's own endpoints (scoring,
reranking in Jina's and Cohere's v2 shape, the tokenizer), each for a key's models only.
The OpenAI routes are also served under OpenVINO Model Server's ``/v3`` and Databricks'
``/serving-endpoints``, where the OpenAI client is pointed at them."""

from __future__ import annotations

from fastapi import Request
from starlette.responses import JSONResponse, Response

from serve_app.http.request_handling import as_call
from serve_app.http.routes.table import IngressRoutes, route


class OpenAIRoutes(IngressRoutes):
    """Inference in OpenAI's shape (route label "openai"), and vLLM's ("vllm")."""

    @route("POST", "/v1/chat/completions", "key")
    @route("POST", "/v3/chat/completions", "key")
    @route("POST", "/serving-endpoints/chat/completions", "key")
    async def chat_completions(self, request: Request) -> Response:
        return await self._openai("chat", request)

    @route("POST", "/v1/completions", "key")
    @route("POST", "/v3/completions", "key")
    @route("POST", "/serving-endpoints/completions", "key")
    async def completions(self, request: Request) -> Response:
        return await self._openai("completions", request)

    @route("POST", "/v1/embeddings", "key")
    @route("POST", "/v3/embeddings", "key")
    @route("POST", "/serving-endpoints/embeddings", "key")
    async def embeddings(self, request: Request) -> Response:
        return await self._openai("embeddings", request)

    @route("POST", "/score", "key")
    @route("POST", "/v1/score", "key")
    async def score(self, request: Request) -> Response:
        return await self._handle("vllm", request, as_call("score"))

    @route("POST", "/rerank", "key")
    @route("POST", "/v1/rerank", "key")
    @route("POST", "/v2/rerank", "key")
    async def rerank(self, request: Request) -> Response:
        return await self._handle("vllm", request, as_call("rerank"))

    @route("POST", "/tokenize", "key")
    async def tokenize(self, request: Request) -> Response:
        return await self._handle("vllm", request, as_call("tokenize"))

    @route("POST", "/detokenize", "key")
    async def detokenize(self, request: Request) -> Response:
        return await self._handle("vllm", request, as_call("detokenize"))

    @route("GET", "/v1/models", "key")
    @route("GET", "/v3/models", "key")
    async def list_models(self, request: Request) -> JSONResponse:
        key = await self.authenticator.tenant(request.headers)
        return JSONResponse({"object": "list", "data": await self.gateway.catalog.model_cards(key)})

    @route("GET", "/v1/models/{model_id:path}", "key")
    @route("GET", "/v3/models/{model_id:path}", "key")
    async def retrieve_model(self, model_id: str, request: Request) -> JSONResponse:
        key = await self.authenticator.tenant(request.headers)
        return JSONResponse(await self.gateway.catalog.seen_by(key).model_card(model_id))
