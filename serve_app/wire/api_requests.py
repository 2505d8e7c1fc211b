"""The part of each OpenAI request the gateway itself must understand.

The ingress needs only what routing and admission depend on (model, the
prompt/messages/input being there, stream flags); every other field is
validated by vLLM's own request model in the replica and comes back as a 400
if wrong. Checking these few here keeps obviously broken requests off the
replicas and gives precise errors.
"""

from __future__ import annotations

import gc
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NoReturn, Protocol, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)

from contract.replica_wire import ReplicaOperation
from serve_app.errors import OpenAIError, invalid_request, shown


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None


def _roles(*allowed: str) -> AfterValidator:
    """A list of messages whose every item is an object with one of ``allowed`` as its
    role; content shapes are vLLM's business. A loop, not a model per message: it runs
    on the event loop, and a model (or TypedDict) per message took 5x longer on a body
    of many small ones (bench/body_parse.py)."""
    roles = frozenset(allowed)

    def check(messages: list[Any]) -> list[Any]:
        for index, message in enumerate(messages):
            role = message.get("role") if type(message) is dict else None
            if type(role) is not str or role not in roles:
                got = shown(message.get("role")) if type(message) is dict else f"a {type(message).__name__}"
                raise ValueError(f"item {index} must be an object whose role is one of {sorted(roles)}, got {got}")
        return messages

    return AfterValidator(check)


# OpenAI's roles; vLLM alone would accept any string as a role.
ChatMessages = Annotated[list[Any], _roles("system", "developer", "user", "assistant", "tool", "function")]
# Anthropic's: the system prompt is a field of its own.
AnthropicMessages = Annotated[list[Any], _roles("user", "assistant")]


class ChatEnvelope(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    messages: ChatMessages = Field(min_length=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None


# Token ids one /detokenize may send: more than any context; bounds the work.
MAX_DETOKENIZE_TOKENS = 1_000_000

# OpenAI's (and vLLM's) max_tokens when a completions request names none.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _prompt_shape(value: Any) -> Any:
    """Exact types in a loop (bool is not an int here, as in strict mode): pydantic's
    union of the four list types took 115 ms on the loop for 500,000 token ids."""
    if type(value) is str:
        return value
    if type(value) is list and (
        all(type(item) is str for item in value)
        or all(type(item) is int for item in value)
        or all(type(item) is list and all(type(token) is int for token in item) for item in value)
    ):
        return value
    raise ValueError("expected a string, an array of strings, an array of token ids or an array of such arrays")


# A prompt as OpenAI accepts it: text, texts, token ids, or lists of token ids.
Prompt = Annotated[
    Any, PlainValidator(_prompt_shape, json_schema_input_type=str | list[str] | list[int] | list[list[int]])
]


class CompletionEnvelope(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    prompt: Prompt
    stream: bool | None = False
    stream_options: StreamOptions | None = None


# Inputs one embeddings request may hold (OpenAI's bound): an answer is ~8 kB per
# input at 1,024 dimensions, so this bounds what one answer carries back.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingEnvelope(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    input: Prompt
    stream: Literal[False] | None = None

    @field_validator("input")
    @classmethod
    def _bounded_inputs(cls, value: Prompt) -> Prompt:
        # A list of token ids is one input; a list of texts or of token lists is many.
        if isinstance(value, list) and value and not isinstance(value[0], int) and len(value) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(value)}")
        return value


class MessagesEnvelope(BaseModel):
    """Anthropic's Messages request: ``max_tokens`` is required there."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    messages: AnthropicMessages = Field(min_length=1)
    max_tokens: int
    stream: bool | None = False


class ResponsesEnvelope(BaseModel):
    """OpenAI's Responses request as the gateway needs it (vLLM checks the items)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    input: str | list[Any]
    stream: bool | None = False


class CountTokensEnvelope(BaseModel):
    """Anthropic's messages.count_tokens: the Messages request without generation."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    messages: AnthropicMessages = Field(min_length=1)
    stream: Literal[False] | None = None


class TokenizeEnvelope(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the model's template."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    prompt: str | None = None
    messages: ChatMessages | None = Field(default=None, min_length=1)
    stream: Literal[False] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeEnvelope:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either 'prompt' or 'messages'")
        return self


class DetokenizeEnvelope(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_TOKENS)
    stream: Literal[False] | None = None


class ScoringEnvelope(BaseModel):
    """vLLM's /score and /rerank: its request models check the pairs and documents."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    stream: Literal[False] | None = None


@dataclass(frozen=True)
class Operation:
    """One endpoint as the gateway sees it."""

    name: ReplicaOperation  # "chat", "completions", "responses", "messages", "count_tokens", "embeddings", "score", ...
    envelope: type[BaseModel]
    generates: bool  # produces completion tokens (reserved up front; may stream)
    # The request id goes into the body (vLLM's request model has the field: the
    # engine's logs and aborts name it); vLLM's tokenizer requests have none.
    carries_request_id: bool = True
    streams_as: str = "openai"  # the SSE shape of its streams: "openai", "responses" or "anthropic"
    replica: ReplicaOperation | None = None  # what the replica runs, where it differs from ``name``
    # Runs a prompt through the engine, so its prefix cache is salted by tenant
    # (serve_app/identity/cache_isolation.py); the tokenizer routes put none in it.
    cache_salted: bool = True

    @property
    def replica_operation(self) -> ReplicaOperation:
        return self.replica or self.name


OPERATIONS: dict[str, Operation] = {
    op.name: op
    for op in (
        Operation("chat", ChatEnvelope, generates=True),
        Operation("completions", CompletionEnvelope, generates=True),
        Operation("embeddings", EmbeddingEnvelope, generates=False),
        # OpenAI's Responses API, by vLLM's; its state (store, previous_response_id) in Redis.
        Operation("responses", ResponsesEnvelope, generates=True, streams_as="responses"),
        # Anthropic's Messages API, by vLLM's Anthropic layer (its request model has no request id).
        Operation("messages", MessagesEnvelope, generates=True, carries_request_id=False, streams_as="anthropic"),
        Operation("count_tokens", CountTokensEnvelope, generates=False, carries_request_id=False, cache_salted=False),
        # Relevance of text pairs (a cross-encoder, or an embedding model's cosine similarity).
        Operation("score", ScoringEnvelope, generates=False),
        Operation("rerank", ScoringEnvelope, generates=False),
        # The tokenizer only: nothing generated, nothing charged but the request.
        Operation("tokenize", TokenizeEnvelope, generates=False, carries_request_id=False, cache_salted=False),
        Operation("detokenize", DetokenizeEnvelope, generates=False, carries_request_id=False, cache_salted=False),
    )
}

# Completions whose prompts are each sent as a user message through the model's
# chat template (Databricks' default for chat models), one choice per prompt.
# Admitted, reserved and accounted exactly as completions.
TEMPLATED_COMPLETIONS = Operation("completions", CompletionEnvelope, generates=True, replica="templated_completions")


class Envelope(Protocol):
    """What every operation's envelope has: the model it names."""

    model: str


def validate_request(operation: Operation, body: dict[str, Any]) -> Envelope:
    """The envelope of ``body`` for ``operation``, or a 400 naming the parameter."""
    try:
        return cast(Envelope, operation.envelope.model_validate(body))
    except ValidationError as exc:
        raise invalid_request(exc) from None


# More JSON values than any request a model can take holds (2,048 embedding inputs
# of 256 token ids; a prompt of as many token ids is past every context): a body that
# may hold more is refused before it is parsed. Parsing, validating and handing a
# request to vLLM cost per value, not per byte, all on the event loop that relays
# everyone's streams (a thread would not help: json's and pydantic's C code hold the
# GIL). Before this bound 8 MiB of ``[]`` took 3.2 s to parse, 8 MiB of one-letter
# messages 2.5 s to parse and validate (bench/body_parse.py). Counted from the bytes
# in one pass (6 ms for 8 MiB): every value but the body itself is its container's
# first (after its ``{`` or ``[``) or follows a ``,``; those inside strings count too,
# so the count bounds the values from above.
MAX_JSON_VALUES = 524_288


def check_message_count(messages: Any, context_length: int, param: str = "messages") -> None:
    """A 400 for more messages (or Responses input items) than the model's context has
    tokens: every chat template renders a message to one token at least, so such a
    request cannot run, and vLLM's validation of it costs ~3 µs a message on the
    event loop of the replica that relays everyone's streams before it says so."""
    if isinstance(messages, list) and len(messages) > context_length:
        raise OpenAIError(
            400,
            f"Invalid '{param}': array too long. Expected an array with maximum length {context_length} "
            f"(the model's context length), but got an array with length {len(messages)} instead.",
            param=param,
            code="array_above_max_length",
        )


# Deeper JSON than any request shape needs (a JSON schema in response_format or a
# tool is the deepest); beyond it, the parser, validation and pickling to a replica
# would all recurse on the client's say-so.
MAX_JSON_DEPTH = 100


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    marks = raw.translate(None, _ALL_BUT_VALUE_MARKS)  # its ',', '{' and '[' bytes: one pass in C
    if len(marks) > MAX_JSON_VALUES:
        raise OpenAIError(
            400,
            f"The JSON body of your request may hold more than {MAX_JSON_VALUES:,} values: it has "
            f"{len(marks):,} ',', '{{' and '[' characters (strings included), and at most "
            f"{MAX_JSON_VALUES:,} are taken.",
            code="json_too_large",
        )
    collecting = gc.isenabled()
    try:
        # No cycle collection while the parser allocates: what it makes has no cycles,
        # and passes triggered by its many new containers tripled the cost of a body
        # of small ones.
        gc.disable()
        # NaN, Infinity and numbers beyond a float are not JSON (Python's parser takes them).
        body = json.loads(raw, parse_constant=_not_a_number, parse_float=_finite)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise OpenAIError(400, f"We could not parse the JSON body of your request: {exc}") from None
    finally:
        if collecting:
            gc.enable()
    if not isinstance(body, dict):
        raise OpenAIError(400, "The request body must be a JSON object.")
    # Only a body with that many brackets can be that deep: most skip the walk.
    if len(marks) - marks.count(b",") > MAX_JSON_DEPTH and _deeper_than(body, MAX_JSON_DEPTH):
        raise _too_deep()
    # A \uD800-\uDFFF escape not in a pair decodes to text no tokenizer takes;
    # only bodies with such escapes (emoji from ensure_ascii clients) are walked.
    if SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(body):
        raise OpenAIError(
            400,
            "The JSON body of your request has an unpaired \\u surrogate escape (not Unicode text).",
            code="invalid_unicode",
        )
    return body


_ALL_BUT_VALUE_MARKS = bytes(c for c in range(256) if c not in b",{[")

SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _not_a_number(constant: str) -> NoReturn:
    raise ValueError(f"{constant} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for name, child in items:
            for text in (name, child):
                if isinstance(text, str):
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        return True
            if isinstance(child, (dict, list)):
                stack.append(child)
    return False


def _deeper_than(value: Any, limit: int) -> bool:
    """Level by level, exact types (what json.loads makes): 2.6x faster than a stack of
    (node, depth) pairs on a body of many small objects."""
    level, depth = [value], 1
    while level:
        if depth > limit:
            return True
        below = []
        for node in level:
            for child in node.values() if type(node) is dict else node:
                if type(child) is dict or type(child) is list:
                    below.append(child)
        level, depth = below, depth + 1
    return False


def _too_deep() -> OpenAIError:
    return OpenAIError(
        400, f"The JSON body of your request is nested more than {MAX_JSON_DEPTH} levels deep.", code="json_too_deep"
    )


# An integer as a query string may spell it: ASCII digits only (str.isdigit takes
# '²', which int() refuses, and '１', which int() reads as 1).
_QUERY_INT = re.compile(r"[0-9]{1,9}")


def list_params(params: Mapping[str, str], default_limit: int = 20, max_limit: int = 100) -> dict[str, Any]:
    """``limit`` (1 to ``max_limit``), ``order`` (asc, or desc: the default) and
    ``after`` of one of OpenAI's listings, or a 400 naming the one that is wrong."""
    limit = params.get("limit", str(default_limit))
    if not _QUERY_INT.fullmatch(limit) or not 1 <= int(limit) <= max_limit:
        raise OpenAIError(400, f"Invalid 'limit': {shown(limit)}; an integer from 1 to {max_limit}.", param="limit")
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise OpenAIError(400, f"Invalid 'order': {shown(order)}; 'asc' or 'desc'.", param="order")
    return {"limit": int(limit), "order": order, "after": params.get("after")}


# OpenAI's bounds on an object's ``metadata`` (batches, responses).
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def check_metadata(metadata: Any) -> None:
    """A 400 unless ``metadata`` is None or at most 16 string pairs within OpenAI's lengths."""
    if metadata is None or (
        isinstance(metadata, dict)
        and len(metadata) <= METADATA_PAIRS
        and all(
            isinstance(k, str)
            and len(k) <= METADATA_KEY_CHARS
            and isinstance(v, str)
            and len(v) <= METADATA_VALUE_CHARS
            for k, v in metadata.items()
        )
    ):
        return
    raise OpenAIError(
        400,
        f"'metadata' must be at most {METADATA_PAIRS} string pairs (keys up to "
        f"{METADATA_KEY_CHARS} characters, values up to {METADATA_VALUE_CHARS}).",
        param="metadata",
        code="invalid_value",
    )
