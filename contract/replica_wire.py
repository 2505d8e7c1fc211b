"""The values that cross a replica call: the ingress calls a model's Serve
deployment (``VLLMReplica``) through a handle; what comes back is one of
these small frozen classes (cheap to pickle) or plain SSE text.

- every call names its ``prompt_allowance``: the prompt tokens the gateway reserved
  for it (None for what puts no prompt into the engine); a larger prompt is refused
  with ``PROMPT_OVER_ALLOWANCE`` before the engine sees it.
- ``call(operation, body)`` returns a ``ReplicaAnswer`` (the JSON body vLLM
  answered and its ``Usage``) or a ``ReplicaError``; ``call_streamed`` yields that
  one value as a stream, which is how the gateway sends it (Serve's gRPC transport
  hands a stream to its caller when a replica takes it, a unary call only at its end).
- ``stream(operation, body)`` yields a ``StreamStart`` (which replica, and the
  first SSE text), then SSE text (``str``; several events per item when they
  pile up); or exactly one ``ReplicaError`` when the request failed before
  streaming. The stream's ``Usage`` is its trailer: vLLM's final usage event
  just before ``data: [DONE]``, which the ingress always asks for and reads
  (``serve_app.wire.sse.take_usage``) without parsing the chunks in between.

``operation`` is a ``ReplicaOperation`` (below: the one list both sides use); the body is the
request of that API (OpenAI's; Anthropic's for "messages"; vLLM's for the
rest) as a dict. A "messages" stream is Anthropic's SSE: its usage is in the
``message_delta`` event, and its end is ``message_stop``; a "responses" stream
is the Responses API's typed events, its usage in ``response.completed``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

# What a replica runs: the gateway's operations (serve_app/wire/api_requests.py OPERATIONS)
# and the replica's endpoints (replicas/vllm_engine.py endpoints) are both checked
# against this list (tests/unit/test_replica_wire.py).
ReplicaOperation = Literal[
    "chat",
    "completions",
    "templated_completions",
    "responses",
    "messages",
    "count_tokens",
    "embeddings",
    "score",
    "rerank",
    "tokenize",
    "detokenize",
]
REPLICA_OPERATIONS: frozenset[str] = frozenset(get_args(ReplicaOperation))


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens a request used, as settled against the key's quotas. ``cached_prompt_tokens``
    is the part of the prompt the engine found in its prefix cache (priced apart)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0

    @classmethod
    def from_openai(cls, usage: Mapping[str, Any] | None) -> Usage | None:
        """From an OpenAI ``usage`` object; None when there is none."""
        if not usage:
            return None
        details = usage.get("prompt_tokens_details") or {}
        return cls(
            int(usage.get("prompt_tokens") or 0),
            int(usage.get("completion_tokens") or 0),
            int(details.get("cached_tokens") or 0),
        )

    @classmethod
    def from_input_output(cls, usage: Mapping[str, Any] | None) -> Usage | None:
        """From an ``input_tokens``/``output_tokens`` usage object (OpenAI's Responses
        API, Anthropic's Messages API): the prompt is the input tokens and the cached
        ones Anthropic counts apart; None when there is none. Cached: OpenAI's
        ``input_tokens_details.cached_tokens`` (part of ``input_tokens``), or
        Anthropic's ``cache_read_input_tokens``."""
        if not usage:
            return None
        prompt = sum(
            int(usage.get(name) or 0)
            for name in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        )
        details = usage.get("input_tokens_details") or {}
        cached = int(details.get("cached_tokens") or usage.get("cache_read_input_tokens") or 0)
        return cls(prompt, int(usage.get("output_tokens") or 0), cached)


@dataclass(frozen=True, slots=True)
class ReplicaAnswer:
    """A unary request answered: the OpenAI response as JSON bytes, sent on as is."""

    body: bytes
    usage: Usage | None
    replica: str


@dataclass(frozen=True, slots=True)
class ReplicaError:
    """The replica refused or failed the request before any output: an HTTP
    status and OpenAI's error fields (``message``, ``param``, ``code``: vLLM's
    ErrorInfo, or the replica's own)."""

    status: int
    error: dict[str, Any]
    replica: str = ""

    @property
    def prompt_over_allowance(self) -> int | None:
        """The prompt's real token count when the replica refused it for exceeding
        the prompt tokens the gateway reserved (``prompt_allowance``), else None."""
        if self.status == PROMPT_OVER_ALLOWANCE_STATUS and self.error.get("code") == PROMPT_OVER_ALLOWANCE:
            return int(self.error["prompt_tokens"])
        return None


# A call's ``prompt_allowance`` (the prompt tokens the gateway reserved for it) is
# enforced where the prompt is rendered (replicas/prompt_allowance.py): a request
# whose prompts come to more is answered this ReplicaError, nothing having run.
# The keyword of a replica call that names the replicas which failed it before (the
# gateway sends a retry with it): the gateway's request router leaves them out of its
# choice (serve_app/routing/serve_routers.py); the replica accepts it and ignores it.
AVOID = "avoid"

PROMPT_OVER_ALLOWANCE = "prompt_over_allowance"
PROMPT_OVER_ALLOWANCE_STATUS = 409


@dataclass(frozen=True, slots=True)
class StreamStart:
    """A stream's first item: which replica serves it, and its first SSE text."""

    replica: str
    text: str


async def as_replica_stream(replica: str, texts: AsyncIterator[str]) -> AsyncIterator[StreamStart | ReplicaError | str]:
    """The replica side of a stream: its first text as a ``StreamStart``, the rest as
    is; a first text that is the server's error event (``failed_before_output``) as a
    ``ReplicaError``, and nothing after it."""
    first = True
    async for text in texts:
        if first:
            first = False
            failed = failed_before_output(replica, text)
            if failed is not None:
                yield failed
                return
            yield StreamStart(replica, text)
        else:
            yield text


_ERROR_EVENT = 'data: {"error"'


def failed_before_output(replica: str, text: str) -> ReplicaError | None:
    """The ``ReplicaError`` of a stream whose first event is an error of the server's
    (a 5xx: vLLM's event when its engine died before the request's first token), else
    None. Nothing of it was generated, so it is a failure before the first byte (the
    gateway sends it to another replica), not a stream to relay; a 4xx stays the
    stream's own event."""
    if not text.startswith(_ERROR_EVENT):
        return None
    try:
        error = json.loads(text[len("data: ") :].split("\n\n", 1)[0])["error"]
        status = int(error["code"])
    except (ValueError, KeyError, TypeError):
        return None
    return ReplicaError(status, error, replica) if status >= 500 else None
