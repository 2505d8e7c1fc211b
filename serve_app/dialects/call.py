"""What a dialect hands to the gateway, and how the answer goes back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response

from serve_app.gateway import Reply


@dataclass
class Call:
    operation: str  # "chat" | "completions" | "embeddings"
    body: dict[str, Any]  # the canonical OpenAI request
    respond: Callable[[Reply], Response] = field(default=Reply.response)
