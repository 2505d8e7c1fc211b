"""The part of each OpenAI request the gateway itself must understand.

The ingress needs only what routing and admission depend on (model, the
prompt/messages/input being there, stream flags); every other field is
validated by vLLM's own request model in the replica and comes back as a 400
if wrong. Checking these few here keeps obviously broken requests off the
replicas and gives precise errors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serve_app.errors import OpenAIError


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None


class ChatMessage(BaseModel):
    """Only the role is checked here; content shapes are vLLM's business."""

    model_config = ConfigDict(extra="allow")
    # OpenAI's roles; vLLM alone would accept any string as a role.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatEnvelope(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None


# OpenAI's (and vLLM's) max_tokens when a completions request names none.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# A prompt as OpenAI accepts it: text, texts, token ids, or lists of token ids.
Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionEnvelope(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    prompt: Prompt
    stream: bool | None = False
    stream_options: StreamOptions | None = None


class EmbeddingEnvelope(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    input: Prompt
    stream: Literal[False] | None = None


@dataclass(frozen=True)
class Operation:
    """One OpenAI endpoint as the gateway sees it."""

    name: str  # the replica's name for it: "chat", "completions", "embeddings"
    envelope: type[BaseModel]
    generates: bool  # produces completion tokens (reserved up front; may stream)


OPERATIONS = {
    op.name: op
    for op in (
        Operation("chat", ChatEnvelope, generates=True),
        Operation("completions", CompletionEnvelope, generates=True),
        Operation("embeddings", EmbeddingEnvelope, generates=False),
    )
}


def validate_request(operation: Operation, body: dict[str, Any]) -> BaseModel:
    """The envelope of ``body`` for ``operation``, or a 400 naming the parameter."""
    try:
        return operation.envelope.model_validate(body)
    except ValidationError as exc:
        raise _as_invalid_request(exc) from None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise OpenAIError(400, f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "The request body must be a JSON object.")
    return body


def _as_invalid_request(exc: ValidationError) -> OpenAIError:
    first = exc.errors(include_url=False)[0]
    loc = [str(part) for part in first.get("loc", ())]
    param = loc[0] if loc else None
    where = ".".join(loc)
    if first.get("type") == "missing":
        message = f"Missing required parameter: '{where}'."
    elif where == "messages" and first.get("type") == "too_short":
        message = "'messages' must contain at least one message."
    else:
        message = f"Invalid value for '{where}': {first.get('msg')}."
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    return OpenAIError(400, message, param=param, code=code)
