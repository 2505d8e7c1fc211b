"""The platforms users migrate from, each translated into the OpenAI call it means
(serve_app/dialects/): Anthropic's Messages API, Azure AI model inference, SageMaker LMI
and Databricks' serving endpoints; errors in each one's own envelope."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.responses import Response

from serve_app.dialects import anthropic, azure, databricks, sagemaker
from serve_app.errors import OpenAIError
from serve_app.http.request_handling import as_call
from serve_app.http.routes.table import IngressRoutes, route
from serve_app.identity.keys import KeyRecord
from serve_app.wire.calls import Call


class DialectRoutes(IngressRoutes):
    """Anthropic, Azure AI model inference, SageMaker LMI, Databricks."""

    @route("POST", "/v1/messages", "key")
    async def anthropic_messages(self, request: Request) -> Response:
        return await self._handle("anthropic", request, as_call("messages"), anthropic.error_response)

    @route("POST", "/v1/messages/count_tokens", "key")
    async def anthropic_count_tokens(self, request: Request) -> Response:
        return await self._handle("anthropic", request, as_call("count_tokens"), anthropic.error_response)

    async def _azure(self, operation: str, request: Request) -> Response:
        async def translate(body: dict[str, Any], key: KeyRecord) -> Call:
            return await azure.translate(operation, body, request.headers, self.gateway.catalog.seen_by(key))

        return await self._handle("azure", request, translate, on_error=azure.error_response)

    @route("POST", "/chat/completions", "key")
    @route("POST", "/models/chat/completions", "key")
    async def azure_chat_completions(self, request: Request) -> Response:
        return await self._azure("chat", request)

    @route("POST", "/embeddings", "key")
    @route("POST", "/models/embeddings", "key")
    async def azure_embeddings(self, request: Request) -> Response:
        return await self._azure("embeddings", request)

    @route("GET", "/info", "key")
    @route("GET", "/models/info", "key")
    async def azure_info(self, request: Request) -> Response:
        try:
            key = await self.authenticator.tenant(request.headers)
            return await azure.info(key, request.headers, self.gateway.catalog.seen_by(key))
        except OpenAIError as exc:
            return azure.error_response(exc)

    @route("POST", "/invocations", "key")
    async def sagemaker_invocations(self, request: Request) -> Response:
        return await self._handle(
            "sagemaker", request, lambda body, key: sagemaker.translate(body, self.gateway.catalog.seen_by(key))
        )

    @route("POST", "/serving-endpoints/{name}/invocations", "key")
    async def databricks_invocations(self, name: str, request: Request) -> Response:
        return await self._handle(
            "databricks", request, lambda body, key: databricks.translate(name, body, self.gateway.catalog.seen_by(key))
        )
