"""``reasoning_content`` beside vLLM's ``reasoning``.

vLLM returns a reasoning model's thinking as ``reasoning``; clients written
for DeepSeek's API (and the many gateways that copied it) read
``reasoning_content``, the name vLLM itself used before. The replica sends
both, and only for models with a reasoning parser: other models never carry
the field, so their streams are never parsed for it.
"""

from __future__ import annotations

import json
from typing import Any

_MARK = '"reasoning":'


def add_to_response(response: dict[str, Any]) -> None:
    """A full chat response: copy each message's ``reasoning``."""
    for choice in response.get("choices") or ():
        message = choice.get("message") or {}
        if message.get("reasoning") is not None:
            message["reasoning_content"] = message["reasoning"]


def add_to_stream(text: str, start_tag: str | None = None) -> str:
    """SSE text (one or more events): copy each delta's ``reasoning``, without
    the parser's ``start_tag`` at its start. Events without reasoning pass
    through untouched (no parsing).

    vLLM 0.32's thinking parsers (``BaseThinkingReasoningParser.extract_reasoning_streaming``,
    "start token in delta, no end token in delta") return a delta's whole text as
    reasoning when the start token comes in one delta with later tokens, which a
    stream of several tokens per chunk (``stream_batch_tokens``) makes common: the
    client would read ``<think>`` as the first of its thinking."""
    if _MARK not in text:
        return text
    events = text.split("\n\n")
    for index, event in enumerate(events):
        if not (event.startswith("data: {") and _MARK in event):
            continue
        chunk = json.loads(event[len("data: ") :])
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning") is not None:
                if start_tag and delta["reasoning"].startswith(start_tag):
                    delta["reasoning"] = delta["reasoning"][len(start_tag) :]
                delta["reasoning_content"] = delta["reasoning"]
        events[index] = "data: " + json.dumps(chunk, separators=(",", ":"))
    return "\n\n".join(events)
