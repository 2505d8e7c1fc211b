"""The few places the ingress looks inside a relayed SSE stream.

For OpenAI-shaped streams only the last item (which ends with
``data: [DONE]``, after the usage event: the stream's usage trailer) is
inspected; the items in between are passed on untouched, so streaming costs
no parsing per chunk. Anthropic-shaped streams (vLLM's Messages API) carry
their usage in the ``message_delta`` event near the end: only an item holding
one is parsed. Dialects that answer in another shape parse every event
(``events``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from contract.replica_wire import Usage

DONE = "data: [DONE]\n\n"


def take_usage(item: str, keep: bool) -> tuple[str, Usage | None]:
    """The usage reported by the stream's final usage event (the one with empty
    ``choices`` just before ``[DONE]``); drop that event unless ``keep``."""
    events = item.split("\n\n")
    # ... "data: {usage event}", "data: [DONE]", ""
    for index in range(len(events) - 1, -1, -1):
        event = events[index]
        if not event.startswith("data: {"):
            continue
        chunk = json.loads(event[len("data: ") :])
        if chunk.get("choices") or "usage" not in chunk:
            return item, None
        if not keep:
            del events[index]
            item = "\n\n".join(events)
        return item, Usage.from_openai(chunk["usage"])
    return item, None


def ends_in_error(item: str) -> bool:
    """Whether ``item`` carries an error event (how vLLM ends a stream its
    engine failed: the error, then ``[DONE]``, no usage)."""
    return 'data: {"error"' in item


def events(item: str) -> list[dict[str, Any]]:
    """Every JSON event of a relayed item, in order (for dialects that answer
    streams in another shape; OpenAI-shaped streams never pay for this)."""
    return [json.loads(event[len("data: ") :]) for event in item.split("\n\n") if event.startswith("data: {")]


def anthropic_usage(item: str) -> Usage | None:
    """The usage of an Anthropic stream's ``message_delta`` event in ``item``
    (vLLM sends the whole count there: input and output tokens), else None."""
    marker = "event: message_delta\ndata: "
    at = item.find(marker)
    if at < 0:
        return None
    line = item[at + len(marker) :].split("\n", 1)[0]
    return Usage.from_input_output(json.loads(line).get("usage"))


def responses_usage(item: str) -> Usage | None:
    """The usage in a Responses stream's ``response.completed`` event in ``item``."""
    response = completed_response(item)
    return Usage.from_input_output(response.get("usage")) if response else None


def completed_response(item: str) -> dict[str, Any] | None:
    """The response a Responses stream's ``response.completed`` event in ``item`` carries."""
    marker = "event: response.completed\ndata: "
    at = item.find(marker)
    if at < 0:
        return None
    response: dict[str, Any] | None = json.loads(item[at + len(marker) :].split("\n", 1)[0]).get("response")
    return response


@dataclass(frozen=True)
class StreamShape:
    """How the relay finds a stream's usage and a failure vLLM ended it with."""

    name: str

    def usage(self, item: str, keep: bool) -> tuple[str, Usage | None]:
        """``item`` as sent on, and the stream's usage if ``item`` carries it."""
        if self.name == "anthropic":
            return item, anthropic_usage(item) if "event: message_delta" in item else None
        if self.name == "responses":
            return item, responses_usage(item) if "event: response.completed" in item else None
        return take_usage(item, keep) if item.endswith(DONE) else (item, None)

    def failed(self, item: str) -> bool:
        if self.name == "anthropic":
            return "event: error\n" in item
        if self.name == "responses":
            return "event: error\n" in item or "event: response.failed\n" in item
        return ends_in_error(item)


STREAM_SHAPES = {name: StreamShape(name) for name in ("openai", "responses", "anthropic")}
