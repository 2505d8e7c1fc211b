"""What happens to request parameters that vLLM does not implement.

vLLM's request models accept (and log as ignored) any field they do not know,
and OpenAI's spec has fields vLLM lacks. A gateway must not silently drop a
parameter that changes what the client gets back, so every such field is in
exactly one of these tables:

- ``IGNORED``: no effect on the generated output on this stack (metadata,
  routing hints for OpenAI's own fleet, a latency hint). Dropped, documented in
  docs/api.md's parameter table.
- ``UNSUPPORTED``: we cannot honour it. 400 naming the parameter, unless it is
  set to the value that means "off".
- ``LLAMACPP_ALIASES``: clients written for llama.cpp-style servers (Jan,
  llama-server) send their own names for some sampling parameters; they are
  renamed to vLLM's. Their samplers vLLM lacks (mirostat, tfs_z, ...) are in
  ``UNSUPPORTED``.

Fields in none of these tables and unknown to vLLM are refused by the replica
("Unrecognized request argument supplied"), as OpenAI does.
"""

from __future__ import annotations

from typing import Any

from serve_app.errors import OpenAIError

MAX_TOP_LOGPROBS = 20

# llama.cpp name -> vLLM name (chat and completions).
LLAMACPP_ALIASES = {"repeat_penalty": "repetition_penalty", "n_predict": "max_tokens"}

# vLLM's own `priority` field: a client setting it would jump other tenants'
# queue. The key's tier decides it (serve_app/pipeline/gateway.py); the client's is dropped.
_GATEWAY_OWNED = frozenset({"priority"})

_LLAMACPP_IGNORED = frozenset(
    {
        "cache_prompt",  # vLLM reuses cached prefixes by itself
        "repeat_last_n",  # vLLM's penalties see the whole sequence; the window is not configurable
        "id_slot",  # llama-server slot pinning
    }
)

IGNORED: dict[str, frozenset[str]] = {
    "chat": frozenset(
        {
            "metadata",  # stored-completion tags; nothing is stored
            "service_tier",  # OpenAI's capacity tiers; one tier here
            "safety_identifier",  # abuse tracking id for OpenAI
            # (prompt_cache_key: read by the gateway as a routing hint before this
            # policy runs; serve_app/identity/cache_isolation.py)
            "prompt_cache_retention",
            "prompt_cache_options",
            "prediction",  # predicted outputs only cut latency; the answer is the same
        }
    )
    | _LLAMACPP_IGNORED
    | _GATEWAY_OWNED,
    "completions": _LLAMACPP_IGNORED | _GATEWAY_OWNED,
    "embeddings": _GATEWAY_OWNED,
    "messages": _GATEWAY_OWNED,
    "count_tokens": _GATEWAY_OWNED,
    "responses": _GATEWAY_OWNED | {"service_tier", "safety_identifier", "prompt_cache_retention"},
    "score": _GATEWAY_OWNED,
    "rerank": _GATEWAY_OWNED,
    "tokenize": _GATEWAY_OWNED,
    "detokenize": _GATEWAY_OWNED,
}

_ALWAYS = object()  # no value is "off": the parameter is always refused

# llama.cpp samplers vLLM lacks: parameter -> (values that mean "off", why).
_LLAMACPP_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "mirostat": ((0,), "mirostat sampling is not implemented by the engine"),
    "mirostat_tau": (_ALWAYS, "mirostat sampling is not implemented by the engine"),
    "mirostat_eta": (_ALWAYS, "mirostat sampling is not implemented by the engine"),
    "tfs_z": ((1, 1.0), "tail-free sampling is not implemented by the engine"),
    "typical_p": ((1, 1.0), "typical sampling is not implemented by the engine"),
    "dynatemp_range": ((0, 0.0), "dynamic temperature is not implemented by the engine"),
    "xtc_probability": ((0, 0.0), "XTC sampling is not implemented by the engine"),
    "dry_multiplier": ((0, 0.0), "DRY sampling is not implemented by the engine"),
    "grammar": (_ALWAYS, "GBNF grammars are not accepted; use response_format json_schema or structured_outputs"),
    "samplers": (_ALWAYS, "the sampler order is fixed by the engine"),
}

# vLLM's beam search runs outside its scheduler's request path: it drops the priority the
# gateway sets from the key's tier, so a low tier's (or a batch line's) beams would run
# ahead of every interactive tier on a priority-scheduled model, and it takes width × n
# sequences the reservation does not price.
_BEAM_SEARCH = {"use_beam_search": ((False,), "beam search is not available; sample with n instead")}

UNSUPPORTED: dict[str, dict[str, tuple[Any, str]]] = {
    "chat": {
        **_BEAM_SEARCH,
        "functions": (_ALWAYS, "the deprecated functions API is not supported; send 'tools'"),
        "function_call": (_ALWAYS, "the deprecated functions API is not supported; send 'tool_choice'"),
        "audio": (_ALWAYS, "audio output is not supported"),
        "modalities": (("text",), "only text output is supported"),
        "web_search_options": (_ALWAYS, "web search is not available"),
        "store": ((False,), "stored completions are not supported"),
        "verbosity": (_ALWAYS, "verbosity is not supported"),
        "moderation": (_ALWAYS, "moderation is not available"),
        **_LLAMACPP_UNSUPPORTED,
    },
    "completions": {
        "best_of": ((1,), "best_of is not supported by the engine; use n"),
        **_BEAM_SEARCH,
        **_LLAMACPP_UNSUPPORTED,
    },
    "embeddings": {"stream": ((False,), "embeddings do not stream")},
    "messages": {},
    "count_tokens": {},
    "responses": {
        "background": ((False,), "background responses are not supported; stream instead"),
        "conversation": (_ALWAYS, "conversation objects are not supported; chain responses with previous_response_id"),
        "prompt": (_ALWAYS, "stored prompt templates are not supported; send the input"),
    },
    "score": {},
    "rerank": {},
    "tokenize": {},
    "detokenize": {},
}


def apply_parameter_policy(operation: str, body: dict[str, Any]) -> None:
    """Rename llama.cpp aliases, drop ignored parameters, refuse unsupported
    ones; ``body`` is changed in place."""
    if operation in ("chat", "completions"):
        _rename_aliases(body)
    for name in IGNORED[operation] & body.keys():
        del body[name]
    unsupported = UNSUPPORTED[operation]
    for name in [name for name in body if name in unsupported]:  # request order: the first is named
        off, why = unsupported[name]
        if body[name] is not None and not _is_off(body[name], off):
            raise OpenAIError(400, f"Unsupported parameter: '{name}': {why}.", param=name, code="unsupported_parameter")
        del body[name]
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise OpenAIError(
            400,
            f"Invalid 'top_logprobs': must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top!r}.",
            param="top_logprobs",
            code="invalid_value",
        )


def _rename_aliases(body: dict[str, Any]) -> None:
    for alias, name in LLAMACPP_ALIASES.items():
        if alias not in body:
            continue
        value = body.pop(alias)
        if name in body and body[name] != value:
            raise OpenAIError(
                400, f"'{alias}' and '{name}' are the same parameter; send one.", param=alias, code="invalid_value"
            )
        body[name] = value


def _is_off(value: Any, off: Any) -> bool:
    if off is _ALWAYS:
        return False
    if isinstance(value, list):
        return bool(tuple(value) == off)
    return bool(value in off)
