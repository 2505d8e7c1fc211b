"""The prompt tokens a request may put into the engine, enforced where they are counted.

The gateway reserves a request's tokens in Redis before it runs, from an estimate
of its prompt (serve_app/wire/reservation.py): the real count needs the model's
chat template, tokenizer and multimodal processor, which only the replica runs.
So the replica is where the bound is enforced: the gateway sends the prompt tokens
it reserved as the request's allowance, and vLLM's renderer — the one step every
engine input of every operation passes through, after templating, tokenization
and multimodal expansion — counts each rendered prompt against it. A request
whose prompts exceed it never reaches the engine: its handler fails, the replica
answers ``PROMPT_OVER_ALLOWANCE`` with the real count, and the gateway reserves
that count and sends it again (serve_app/pipeline/gateway.py). What the engine
reports as ``prompt_tokens`` is therefore never more than what was reserved, for
any text, template, tool list or image, by construction rather than by estimate.

The allowance travels in a context variable: the replica sets it around the vLLM
handler's call, and rendering happens inside that call (a stream is returned only
once its prompt is rendered); ``asyncio.gather`` of the renderer copies the
context, and the allowance object it holds is shared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any


class PromptOverAllowance(ValueError):
    """Raised inside vLLM's renderer; vLLM's handlers turn a ValueError into an
    error response, and the replica reads the allowance, not the message."""


class PromptAllowance:
    """The prompt tokens one request may use, and those its prompts counted so far."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    @property
    def exceeded(self) -> bool:
        return self.used > self.limit

    def take(self, tokens: int) -> None:
        self.used += tokens
        if self.exceeded:
            raise PromptOverAllowance(f"the prompt has {self.used} tokens, {self.limit} were reserved")


_CURRENT: ContextVar[PromptAllowance | None] = ContextVar("prompt_allowance", default=None)


@contextlib.contextmanager
def allowing(limit: int | None) -> Iterator[PromptAllowance | None]:
    """Prompts rendered inside count against ``limit`` (None: not counted)."""
    allowance = PromptAllowance(limit) if limit is not None else None
    token = _CURRENT.set(allowance)
    try:
        yield allowance
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Rendering that puts nothing into the engine (a prompt rendered only to be
    tokenized, then sent as token ids that are counted then)."""
    token = _CURRENT.set(None)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def count_rendered(engine_inputs: Any, length) -> None:
    """Charge rendered engine inputs (one, or a list) to the current allowance."""
    allowance = _CURRENT.get()
    if allowance is None:
        return
    inputs = engine_inputs if isinstance(engine_inputs, list) else [engine_inputs]
    allowance.take(sum(length(engine_input) for engine_input in inputs))


def enforce_on(renderer: Any, length: Callable[[Any], int]) -> None:
    """Wrap ``renderer``'s four entry points (vLLM's ``Renderer``: completions and
    chat, sync for pooling and async for generation) so that every prompt they
    render is charged, ``length(engine_input)`` tokens, to the allowance of the
    request being answered."""
    for name in ("render_cmpl", "render_chat"):
        setattr(renderer, name, _counted_sync(getattr(renderer, name), length))
    for name in ("render_cmpl_async", "render_chat_async"):
        setattr(renderer, name, _counted_async(getattr(renderer, name), length))


def _engine_inputs(result: Any) -> Any:
    """``render_chat`` answers (conversations, engine inputs); ``render_cmpl`` the inputs."""
    return result[1] if isinstance(result, tuple) else result


# Set while a counted entry point runs: one that calls another (an async one
# delegating to its sync twin, in some vLLM version) is counted once, by the outer.
_RENDERING: ContextVar[bool] = ContextVar("prompt_allowance_rendering", default=False)


def _counted_sync(method, length):
    def counted(*args, **kwargs):
        if _RENDERING.get():
            return method(*args, **kwargs)
        token = _RENDERING.set(True)
        try:
            result = method(*args, **kwargs)
        finally:
            _RENDERING.reset(token)
        count_rendered(list(_engine_inputs(result)), length)
        return result

    return counted


def _counted_async(method, length):
    async def counted(*args, **kwargs):
        if _RENDERING.get():
            return await method(*args, **kwargs)
        token = _RENDERING.set(True)
        try:
            result = await method(*args, **kwargs)
        finally:
            _RENDERING.reset(token)
        count_rendered(list(_engine_inputs(result)), length)
        return result

    return counted
