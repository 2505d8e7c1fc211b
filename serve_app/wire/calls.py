"""The values that pass between the routes, the dialects and the gateway.

A route (or a dialect's translation) turns a request into a ``Call``: the
operation and the canonical OpenAI body, plus how to render the answer. The
gateway answers a ``Call`` with a ``Reply``. Dialects see the model registry
only through ``ModelRegistry``: the few questions a platform's request shape
needs answered (which model, how long its context), never the whole gateway.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.responses import Response, StreamingResponse

from serve_app.wire.api_requests import Operation


@dataclass
class Reply:
    """A successful answer: a JSON body, or an SSE stream already accounted for."""

    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None
    stream: AsyncIterator[str] | None = None

    def json(self) -> Any:
        """The JSON body of a unary answer."""
        if self.body is None:
            raise ValueError("a stream has no JSON body")
        return json.loads(self.body)

    def response(self) -> Response:
        if self.stream is not None:
            return StreamingResponse(self.stream, media_type="text/event-stream", headers=self.headers)
        return Response(self.body, media_type="application/json", headers=self.headers)


@dataclass
class Call:
    operation: str | Operation  # "chat" | "completions" | ...; an Operation where the replica runs another
    body: dict[str, Any]  # the canonical OpenAI request
    # How the answer reaches the client; may be async (a Responses answer is stored first).
    respond: Callable[[Reply], Response | Awaitable[Response]] = field(default=Reply.response)
    # What undoes the translation's side effects when the gateway answers no Reply
    # (a refusal, an error): the Responses API gives back the storage it reserved.
    abandon: Callable[[], Awaitable[None]] | None = None
    # What the body still needs once the key's quotas let it through (a Responses
    # follow-up's stored conversation, read only for a request admitted), and the
    # bytes it adds to the body, priced before it is read.
    once_admitted: Callable[[], Awaitable[None]] | None = None
    bytes_once_admitted: int = 0


class ModelRegistry(Protocol):
    """What dialects may ask of the gateway about its models."""

    async def only_model_for(self, operation: str | None) -> str:
        """The model for a request that names none, or a 400 asking for one."""

    async def model_card(self, model: str) -> dict[str, Any]:
        """``model``'s card (its details waited for at most its queue timeout)."""

    def resolve(self, model: str) -> str:
        """The configured name behind a name, alias or adapter, or a 404."""

    def authorized(self, key: Any, model: str) -> str:
        """``resolve(model)`` when ``key`` may use it, else a 403."""

    def context_length(self, name: str) -> int | None:
        """A configured model's context length, None while unknown."""
