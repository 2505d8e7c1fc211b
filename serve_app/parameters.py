"""What happens to OpenAI parameters that vLLM does not implement.

vLLM's request models accept (and log as ignored) any field they do not know,
and OpenAI's spec has fields vLLM lacks. A gateway must not silently drop a
parameter that changes what the client gets back, so every such field is in
exactly one of two tables here:

- ``IGNORED``: no effect on the generated output on this stack (metadata,
  routing hints for OpenAI's own fleet, a latency hint). Dropped, documented in
  README's parameter table.
- ``UNSUPPORTED``: we cannot honour it. 400 naming the parameter, unless it is
  set to the value that means "off".

Fields in neither table and unknown to vLLM are refused by the replica
("Unrecognized request argument supplied"), as OpenAI does.
"""

from __future__ import annotations

from typing import Any

from serve_app.errors import OpenAIError

MAX_TOP_LOGPROBS = 20

IGNORED: dict[str, frozenset[str]] = {
    "chat": frozenset(
        {
            "metadata",  # stored-completion tags; nothing is stored
            "service_tier",  # OpenAI's capacity tiers; one tier here
            "safety_identifier",  # abuse tracking id for OpenAI
            "prompt_cache_key",  # vLLM caches prefixes automatically
            "prompt_cache_retention",
            "prompt_cache_options",
            "prediction",  # predicted outputs only cut latency; the answer is the same
        }
    ),
    "completions": frozenset(),
    "embeddings": frozenset(),
}

# parameter -> (the value(s) that mean "off", why we refuse anything else)
_OFF = object()  # marker: no value is "off", the parameter is always refused
UNSUPPORTED: dict[str, dict[str, tuple[Any, str]]] = {
    "chat": {
        "typical_p": (_OFF, "typical sampling is not implemented by the engine"),
        "functions": (_OFF, "the deprecated functions API is not supported; send 'tools'"),
        "function_call": (_OFF, "the deprecated functions API is not supported; send 'tool_choice'"),
        "audio": (_OFF, "audio output is not supported"),
        "modalities": (("text",), "only text output is supported"),
        "web_search_options": (_OFF, "web search is not available"),
        "store": ((False,), "stored completions are not supported"),
        "verbosity": (_OFF, "verbosity is not supported"),
        "moderation": (_OFF, "moderation is not available"),
    },
    "completions": {
        "typical_p": (_OFF, "typical sampling is not implemented by the engine"),
        "best_of": ((1,), "best_of is not supported by the engine; use n"),
    },
    "embeddings": {"stream": ((False,), "embeddings do not stream")},
}


def apply_parameter_policy(operation: str, body: dict[str, Any]) -> None:
    """Drop ignored parameters from ``body`` in place; refuse unsupported ones."""
    for name in IGNORED[operation] & body.keys():
        del body[name]
    for name, (off, why) in UNSUPPORTED[operation].items():
        if name in body and body[name] is not None and not _is_off(body[name], off):
            raise OpenAIError(
                400, f"Unsupported parameter: '{name}': {why}.", param=name, code="unsupported_parameter"
            )
        body.pop(name, None)
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise OpenAIError(
            400,
            f"Invalid 'top_logprobs': must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top!r}.",
            param="top_logprobs",
            code="invalid_value",
        )


def _is_off(value: Any, off: Any) -> bool:
    if off is _OFF:
        return False
    if isinstance(value, list):
        return tuple(value) == off
    return value in off
