"""vLLM's answers as OpenAI's wire format has them: nulls the spec wants absent
dropped, required-but-nullable fields kept, a forced tool call's finish reason,
the Responses API's JSON and SSE, and vLLM's refusals read as errors."""

from __future__ import annotations

import json
from typing import Any

# Fields OpenAI's Response object requires but allows to be null; vLLM's other
# nulls (`user`, `prompt`, ...) are optional fields the spec wants absent.
_RESPONSE_REQUIRED_NULLABLE = frozenset(
    {"error", "incomplete_details", "instructions", "metadata", "temperature", "top_p"}
)


def responses_json(response: dict[str, Any]) -> dict[str, Any]:
    """A full Responses answer as OpenAI's wire format has it."""
    response = {
        key: _drop_nulls(value)
        for key, value in response.items()
        if value is not None or key in _RESPONSE_REQUIRED_NULLABLE
    }
    for key in _RESPONSE_REQUIRED_NULLABLE:
        response.setdefault(key, None)  # vLLM leaves `error` out
    for tool in response.get("tools") or ():
        if tool.get("type") == "function":
            tool.setdefault("strict", None)  # required, nullable
    for item in response.get("output") or ():
        for part in item.get("content") or () if item.get("type") == "message" else ():
            if part.get("type") == "output_text":
                part.setdefault("logprobs", [])  # required; vLLM leaves it null when none were asked
    return response


def _drop_nulls(node: Any) -> Any:
    """Below the top level no field of a Response is required and null (an output
    text's ``logprobs`` is an optional array, unlike chat's)."""
    if isinstance(node, dict):
        return {key: _drop_nulls(value) for key, value in node.items() if value is not None}
    if isinstance(node, list):
        return [_drop_nulls(item) for item in node]
    return node


def readable_responses_input(body: dict[str, Any]) -> None:
    """Each assistant message in a Responses ``input`` as one ``output_text`` part
    holding all its text. vLLM reads only an assistant message's first part, and its
    ``text``: a message with no parts (what vLLM itself answers for an empty output,
    so a continuation of it) raises IndexError, a refusal part AttributeError, both
    500s for what is valid input; a second part is dropped."""
    items = body.get("input")
    if not isinstance(items, list):
        return
    for item in items:
        if not isinstance(item, dict) or item.get("role") != "assistant" or not isinstance(item.get("content"), list):
            continue
        parts = item["content"]
        texts = [_part_text(part) for part in parts]
        if None in texts or (len(parts) == 1 and parts[0].get("type") == "output_text"):
            continue  # one part vLLM reads, or a part its validator refuses (400)
        item["content"] = [{"type": "output_text", "text": "".join(filter(None, texts)), "annotations": []}]


def _part_text(part: Any) -> str | None:
    if not isinstance(part, dict):
        return None
    text = part.get("refusal") if part.get("type") == "refusal" else part.get("text")
    return text if isinstance(text, str) else None


async def responses_sse(events):
    async for event in events:
        data = event.model_dump_json(indent=None, by_alias=True)
        yield f"event: {getattr(event, 'type', 'unknown')}\ndata: {data}\n\n"


# A forced call of one named function ends with finish_reason "stop" in vLLM;
# the gateway reports "tool_calls" for every answer that is a tool call.
FINISH_STOP = '"finish_reason":"stop"'


FINISH_TOOL_CALLS = '"finish_reason":"tool_calls"'


def names_a_tool(body: dict[str, Any]) -> bool:
    return isinstance(body.get("tool_choice"), dict) and bool(body.get("tools"))


def finish_named_tool_calls(response: dict[str, Any]) -> None:
    for choice in response.get("choices") or ():
        if choice.get("finish_reason") == "stop" and (choice.get("message") or {}).get("tool_calls"):
            choice["finish_reason"] = "tool_calls"


# Fields OpenAI's spec requires but allows to be null; every other null is an
# optional field vLLM fills with None where the spec wants it absent
# (e.g. `annotations`, `usage.prompt_tokens_details`).
_REQUIRED_NULLABLE = frozenset({"content", "refusal", "logprobs", "finish_reason"})


def _drop_null_optionals(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            key: _drop_null_optionals(value)
            for key, value in node.items()
            if value is not None or key in _REQUIRED_NULLABLE
        }
    if isinstance(node, list):
        return [_drop_null_optionals(item) for item in node]
    return node


def openai_json(response: dict[str, Any]) -> bytes:
    """A full (non-streamed) response as OpenAI's wire format has it."""
    for choice in response.get("choices") or ():
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and "content" in logprobs:
            logprobs.setdefault("refusal", None)  # chat logprobs: the spec requires it beside content
    return json.dumps(_drop_null_optionals(response), separators=(",", ":")).encode()


def is_error(result: Any) -> bool:
    return type(result).__name__ == "ErrorResponse"


def validation_error(exc) -> dict[str, Any]:
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first.get("loc", ())) or None
    message = f"{first.get('msg', 'invalid value')}" + (f" (at '{param}')" if param else "")
    return {"message": message, "param": param}
