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
context, and the allowance object it holds is shared. vLLM renders pooling
requests (embeddings, score, rerank) on its renderer's thread pool, where a
context variable is not carried by ``run_in_executor``: ``enforce_on`` makes that
pool run each task in the context that submitted it, so the count cannot be lost.

Where it is counted: the renderer's four entry points (a list of prompts counted
whole, so one resize is enough) and ``process_for_engine``, the step every
prompt passes on its way to being an engine input (the cross-encoder's pairs are
rendered through it alone). Where it is enforced: at the render for generation
(the stream is returned after it), and for pooling, whose prompts are rendered one
by one on parallel threads, at the engine's door (``AsyncLLM.add_request``), once
every prompt of the request has been counted (``allowing(limit, whole=True)``).
The door also counts any engine input no render counted: a path vLLM adds later
is bounded too, prompt by prompt.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any


class PromptOverAllowance(ValueError):
    """Raised inside vLLM's renderer; vLLM's handlers turn a ValueError into an
    error response, and the replica reads the allowance, not the message."""


class PromptAllowance:
    """The prompt tokens one request may use, and those its prompts counted so far.
    ``whole``: a render past the limit is not refused at once; the engine's door
    refuses the request once all its prompts are counted. ``counted``: the engine
    inputs (by identity) a render counted; ``at_the_door``: tokens the door counted
    that no render had."""

    __slots__ = ("limit", "used", "whole", "counted", "at_the_door")

    def __init__(self, limit: int, whole: bool = False):
        self.limit, self.used, self.whole = limit, 0, whole
        self.counted: set[int] = set()
        self.at_the_door = 0

    @property
    def exceeded(self) -> bool:
        return self.used > self.limit

    def take(self, tokens: int) -> None:
        self.used += tokens
        if self.exceeded and not self.whole:
            self.refuse()

    def refuse(self) -> None:
        raise PromptOverAllowance(f"the prompt has {self.used} tokens, {self.limit} were reserved")


_CURRENT: ContextVar[PromptAllowance | None] = ContextVar("prompt_allowance", default=None)


@contextlib.contextmanager
def allowing(limit: int | None, whole: bool = False) -> Iterator[PromptAllowance | None]:
    """Prompts rendered inside count against ``limit`` (None: not counted);
    ``whole``: refused at the engine's door, once every prompt is counted."""
    allowance = PromptAllowance(limit, whole) if limit is not None else None
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
    inputs = [engine_inputs] if isinstance(engine_inputs, dict) else list(engine_inputs)
    allowance.counted.update(map(id, inputs))
    allowance.take(sum(length(engine_input) for engine_input in inputs))


def enforce_on(renderer: Any, length: Callable[[Any], int]) -> None:
    """Wrap ``renderer``'s four entry points (vLLM's ``Renderer``: completions and
    chat, sync for pooling and async for generation) and ``process_for_engine``
    (each prompt on its way to the engine; counted only outside an entry point)
    so that every prompt they render is charged, ``length(engine_input)`` tokens,
    to the allowance of the request being answered; and make its thread pools run
    each task in the context of the request that submitted it."""
    for name in ("render_cmpl", "render_chat", "process_for_engine"):
        setattr(renderer, name, _counted_sync(getattr(renderer, name), length))
    for name in ("render_cmpl_async", "render_chat_async", "process_for_engine_async"):
        setattr(renderer, name, _counted_async(getattr(renderer, name), length))
    for name in ("_executor", "_mm_executor"):
        executor = getattr(renderer, name, None)
        if executor is not None:
            carry_context(executor)


def carry_context(executor: Any) -> None:
    """Run each task ``executor`` is given in a copy of the context it was submitted
    from, as ``asyncio.to_thread`` does (``loop.run_in_executor`` does not). The
    object is patched, not replaced: vLLM's ``make_async`` wrappers hold it."""
    submit = executor.submit

    def submit_in_context(fn, /, *args, **kwargs):
        return submit(contextvars.copy_context().run, fn, *args, **kwargs)

    executor.submit = submit_in_context


def guard_the_door(engine: Any, length: Callable[[Any], int]) -> None:
    """Wrap ``engine.add_request`` (vLLM's ``AsyncLLM``: every ``generate`` and
    ``encode`` passes it) so that a request over its allowance adds nothing to the
    engine, and an engine input no render counted is counted there."""
    add_request = engine.add_request

    async def add_counted_request(request_id, prompt, *args, **kwargs):
        allowance = _CURRENT.get()
        if allowance is not None:
            if isinstance(prompt, dict) and id(prompt) not in allowance.counted:
                tokens = length(prompt)
                allowance.at_the_door += tokens
                allowance.counted.add(id(prompt))
                allowance.used += tokens
            if allowance.exceeded:
                allowance.refuse()
        return await add_request(request_id, prompt, *args, **kwargs)

    engine.add_request = add_counted_request


def _engine_inputs(result: Any) -> Any:
    """``render_chat`` answers (conversations, engine inputs); ``render_cmpl`` the
    inputs; ``process_for_engine`` one input."""
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
        count_rendered(_engine_inputs(result), length)
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
        count_rendered(_engine_inputs(result), length)
        return result

    return counted
