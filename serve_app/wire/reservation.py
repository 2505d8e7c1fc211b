"""How many tokens a request may use, decided before it runs.

Admission reserves tokens against a key's tokens/min and budgets before the
engine starts, and the reservation must be an upper bound of what the engine
may generate, whatever the client sends (docs/quotas.md, "Keys and quotas"):

- the generation-size fields (``max_tokens``, ``max_completion_tokens``, ``n``)
  must be real JSON integers in range: vLLM's request models would coerce
  ``"1000"`` or ``1000.0``, so anything else is a 400 naming the parameter here;
- every prompt of a batched completions request generates its own ``n``
  choices, so a list of prompts multiplies the completion budget;
- a request that names no max tokens gets one set explicitly (the gateway's
  documented default, never beyond the model's context), so the engine never
  generates up to the context length on an unbounded reservation. vLLM clamps
  ``max_tokens`` to what the context leaves after the prompt.

The prompt part is an estimate (4 bytes of request body per token, token-id
prompts counted exactly), and it is also a bound: the replica is handed it as the
request's prompt allowance and refuses, before the engine sees it, a prompt that
renders to more tokens (replicas/prompt_allowance.py); the gateway then reserves the
real count and sends the request again (``resized``). So what settlement charges
never exceeds what was reserved, whatever the script, template, tools or media.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

from serve_app.errors import OpenAIError
from serve_app.wire.api_requests import COMPLETIONS_DEFAULT_MAX_TOKENS

MAX_N = 128  # OpenAI's bound on n
MAX_TOKENS_LIMIT = 2**31 - 1  # beyond any context; keeps every sum far below Redis' 2**63
BYTES_PER_PROMPT_TOKEN = 4


@dataclass(frozen=True)
class Reservation:
    prompt: int  # estimated prompt tokens: the most the replica lets the engine take
    completion_per_choice: int  # the max tokens the engine may generate per choice
    choices: int  # n × number of prompts
    runs_prompt: bool = True  # False: the request puts no prompt into the engine (tokenize)
    # The client named no max tokens: (the field, the value) the gateway names for it, so
    # that the engine never picks its own (up to the context) past what was reserved.
    named_for_client: tuple[str, int] | None = None

    @property
    def tokens(self) -> int:
        return self.prompt + self.completion_per_choice * self.choices

    @property
    def prompt_allowance(self) -> int | None:
        """What the replica lets the request's prompts come to (None: not counted)."""
        return self.prompt if self.runs_prompt else None

    def resized(self, prompt_tokens: int) -> Reservation:
        """The reservation of the same request whose prompt the replica counted."""
        return replace(self, prompt=prompt_tokens)


def integer_parameter(body: dict[str, Any], name: str, minimum: int, maximum: int) -> int | None:
    """``body[name]`` as an int in [minimum, maximum], None when absent, else a 400."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpenAIError(
            400,
            f"Invalid type for '{name}': expected an integer, but got {_json_type(value)} instead.",
            param=name,
            code="invalid_type",
        )
    if not minimum <= value <= maximum:
        raise OpenAIError(
            400,
            f"Invalid '{name}': integer below minimum value. Expected a value >= {minimum}, but got {value} instead."
            if value < minimum
            else f"Invalid '{name}': integer above maximum value. Expected a value <= {maximum}, "
            f"but got {value} instead.",
            param=name,
            code="integer_below_min_value" if value < minimum else "integer_above_max_value",
        )
    return value


def reserve(
    operation: str,
    body: dict[str, Any],
    raw_size: int,
    *,
    default_max_tokens: int,
    context_length: int | None,
) -> Reservation:
    """The reservation of a request of ``operation`` ("chat", "completions",
    "embeddings", "score", "rerank", "tokenize", "detokenize", "count_tokens"). ``body`` is read,
    never written: a generating request that names no max tokens gets the reserved
    ones named for it (``named_for_client``), which the gateway sets on its call."""
    if operation in ("tokenize", "detokenize", "count_tokens"):
        return Reservation(0, 0, 0, runs_prompt=False)  # the tokenizer only: a request, no tokens of the budget
    prompt = math.ceil(raw_size / BYTES_PER_PROMPT_TOKEN)
    if operation in ("score", "rerank"):  # every text is a prompt; nothing is generated
        return Reservation(prompt, 0, 0)
    if operation == "embeddings":
        return Reservation(max(prompt, _token_ids(body.get("input"))), 0, 0)
    if operation == "responses":
        return _responses(body, prompt, default_max_tokens, context_length)
    n = integer_parameter(body, "n", 1, MAX_N) or 1
    named = [
        value
        for value in (
            integer_parameter(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT),
            integer_parameter(body, "max_tokens", 0 if operation == "completions" else 1, MAX_TOKENS_LIMIT),
        )
        if value is not None
    ]
    named_for_client: tuple[str, int] | None = None
    if named:
        completion = max(named)  # vLLM uses one of them; reserve for whichever it is
    else:
        completion = COMPLETIONS_DEFAULT_MAX_TOKENS if operation == "completions" else default_max_tokens
        if context_length:
            completion = min(completion, context_length)
        named_for_client = ("max_tokens", completion)
    if context_length:
        completion = min(completion, context_length)  # vLLM clamps to what the context leaves
    prompts = _prompt_count(body.get("prompt")) if operation == "completions" else 1
    if operation == "completions":
        prompt = max(prompt, _token_ids(body.get("prompt")))
    return Reservation(prompt, completion, n * prompts, named_for_client=named_for_client)


def _responses(body: dict[str, Any], prompt: int, default_max_tokens: int, context_length: int | None) -> Reservation:
    """A Responses request: ``max_output_tokens`` bounds generation; the input may
    hold a stored conversation the client did not send (previous_response_id), so
    the prompt is estimated from the input as it goes to the engine."""
    completion = integer_parameter(body, "max_output_tokens", 1, MAX_TOKENS_LIMIT)
    named_for_client = None
    if completion is None:
        completion = min(default_max_tokens, context_length) if context_length else default_max_tokens
        named_for_client = ("max_output_tokens", completion)
    if context_length:
        completion = min(completion, context_length)
    sent = math.ceil(len(json.dumps(body.get("input"))) / BYTES_PER_PROMPT_TOKEN)
    return Reservation(max(prompt, sent), completion, 1, named_for_client=named_for_client)


def _prompt_count(prompt: Any) -> int:
    """Prompts in a completions ``prompt``: text, texts, token ids, lists of token ids."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def _token_ids(prompt: Any) -> int:
    """Tokens given as ids (counted exactly: short ids take fewer than 4 bytes each)."""
    if not isinstance(prompt, list):
        return 0
    return sum(len(item) if isinstance(item, list) else 1 for item in prompt if not isinstance(item, str))


def _json_type(value: Any) -> str:
    kind = {str: "a string", float: "a decimal", bool: "a boolean", list: "an array", dict: "an object"}
    return kind.get(type(value), type(value).__name__)
