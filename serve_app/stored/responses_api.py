"""OpenAI's Responses API: vLLM's Responses layer generates, the gateway keeps
the state.

vLLM stores responses in one process' memory (and only when told to), so a
``previous_response_id`` would work only on the replica that answered it. Here
the conversation is the gateway's: a follow-up's input is the stored
conversation (every earlier input item and output item) plus its own input,
sent to any replica with ``store: false``; the answer is stored in Redis under
the key (``stored_responses.py``). The client sees ``store`` and
``previous_response_id`` as it sent them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from redis.exceptions import RedisError
from starlette.responses import Response, StreamingResponse

from serve_app.errors import OpenAIError
from serve_app.identity.keys import KeyRecord
from serve_app.stored.stored_responses import (
    MAX_STORED_BYTES,
    ResponseStore,
    as_input,
    input_items,
    not_found,
    with_ids,
)
from serve_app.wire.api_requests import OPERATIONS, check_metadata
from serve_app.wire.calls import Call, Reply
from serve_app.wire.sse import completed_response

logger = logging.getLogger("ray.serve")


async def translate(body: dict[str, Any], key: KeyRecord, store: ResponseStore) -> Call:
    previous_id = body.pop("previous_response_id", None)
    if previous_id is not None and (not isinstance(previous_id, str) or not previous_id):
        raise OpenAIError(400, "'previous_response_id' must be a response id.", param="previous_response_id")
    keep = body.pop("store", None)
    keep = True if keep is None else keep
    if not isinstance(keep, bool):
        raise OpenAIError(400, "'store' must be a boolean.", param="store")
    check_metadata(body.get("metadata"))  # stored with the response: OpenAI's bounds
    value = body.get("input")
    if not isinstance(value, (str, list)) or not value:
        raise OpenAIError(
            400,
            "'input' must be a non-empty string or list of items.",
            param="input",
            code="missing_required_parameter" if value is None else "invalid_value",
        )
    own = input_items(value)
    history_bytes = 0
    if previous_id is not None:  # its size now, the conversation itself once admitted
        history_bytes = await _history_bytes(store, key.id, previous_id)
    context = list(own)
    body["input"] = context
    body["store"] = False  # vLLM's own store, one process' memory, stays unused
    stamp = _Stamp(keep, previous_id)
    kept = _Kept(store, key.id)
    context_bytes = history_bytes + len(json.dumps(own))
    if keep:
        if context_bytes > MAX_STORED_BYTES:
            raise OpenAIError(
                400,
                f"The conversation is too long to store (over {MAX_STORED_BYTES} bytes); "
                "start a new one or send it with 'store': false.",
                param="input",
                code="conversation_too_large",
            )
        # What storing it will take: the conversation (kept whole, and its own items
        # again), the request's other fields (the response echoes them) and the answer.
        echoed = len(json.dumps({name: value for name, value in body.items() if name != "input"}))
        await kept.reserve(2 * context_bytes + echoed + ANSWER_ALLOWANCE_BYTES)

    async def load_history() -> None:
        """The stored conversation before the request's own input (its media was
        checked when it was sent)."""
        assert previous_id is not None  # only loaded for a request that continues one
        stored = await _stored(store, key.id, previous_id)
        if stored is None:  # deleted since its size was read
            raise not_found(previous_id)
        context[:0] = stored["context"] + as_input(stored["response"].get("output") or [])

    async def keep_answer(response: dict[str, Any]) -> bool:
        return await kept.put(
            {**response, "store": True, "previous_response_id": previous_id}, context, with_ids(own), context_bytes
        )

    async def respond(reply: Reply) -> Response:
        if reply.stream is not None:
            return StreamingResponse(
                _stored_stream(reply.stream, stamp, keep_answer, kept),
                media_type="text/event-stream",
                headers=reply.headers,
            )
        response = reply.json()
        stored = await keep_answer(response)
        response.update(store=stored, previous_response_id=previous_id)
        return Response(json.dumps(response), media_type="application/json", headers=reply.headers)

    return Call(
        OPERATIONS["responses"],
        body,
        respond,
        abandon=kept.release,
        once_admitted=load_history if previous_id is not None else None,
        bytes_once_admitted=history_bytes,
    )


# What a stored answer may add beyond its conversation and echoed fields, reserved
# before it runs (its real size is what counts once stored).
ANSWER_ALLOWANCE_BYTES = 64 * 1024


class _Kept:
    """A response's room in its key's storage account: reserved before it runs,
    then either its stored record or given back, once."""

    def __init__(self, store: ResponseStore, key_id: str):
        self.store, self.key_id = store, key_id
        self.pending: str | None = None

    async def reserve(self, size: int) -> None:
        try:
            self.pending = await self.store.reserve(self.key_id, size)
        except RedisError:
            raise _store_unavailable("stored") from None

    async def put(self, response: dict[str, Any], context: list, own: list, context_bytes: int) -> bool:
        if self.pending is None:
            return False
        pending, self.pending = self.pending, None
        try:
            await self.store.put(self.key_id, response, context, own, pending, context_bytes)
            return True
        except RedisError:
            logger.exception("could not store response %s", response.get("id"))
            await self._give_back(pending)
            return False

    async def release(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            await self._give_back(pending)

    async def _give_back(self, pending: str) -> None:
        try:
            await self.store.release(self.key_id, pending)
        except RedisError:  # it expires by itself (PENDING_S)
            logger.warning("could not release a stored response's reservation")


class _Stamp:
    """The answer's ``store`` and ``previous_response_id`` as the client sent them
    (vLLM answered a stateless request). A stream's response objects are edited as
    text: in vLLM's compact JSON the two fields can only appear as these literals
    (inside generated text their quotes would be escaped)."""

    def __init__(self, keep: bool, previous_id: str | None):
        self.edits = []
        if keep:
            self.edits.append(('"store":false', '"store":true'))
        if previous_id is not None:
            self.edits.append(('"previous_response_id":null', '"previous_response_id":' + json.dumps(previous_id)))

    def __call__(self, item: str) -> str:
        for old, new in self.edits:
            item = item.replace(old, new)
        return item


async def _stored_stream(stream: AsyncIterator[str], stamp: _Stamp, keep_answer, kept: _Kept) -> AsyncIterator[str]:
    try:
        async for item in stream:
            if "event: response.completed" in item:
                response = completed_response(item)
                if response is not None:
                    await keep_answer(response)
            yield stamp(item) if '"response":{' in item else item  # only events carrying the response object
    finally:
        await asyncio.shield(kept.release())  # never completed (failed, the client gone): nothing stored


async def _stored(store: ResponseStore, key_id: str, response_id: str) -> dict[str, Any] | None:
    try:
        return await store.get(key_id, response_id)
    except RedisError:
        raise _store_unavailable("read") from None


async def _history_bytes(store: ResponseStore, key_id: str, response_id: str) -> int:
    try:
        size = await store.history_bytes(key_id, response_id)
    except RedisError:
        raise _store_unavailable("read") from None
    if size is None:
        raise not_found(response_id)
    return size


async def retrieve(store: ResponseStore, key: KeyRecord, response_id: str) -> dict[str, Any]:
    stored = await _stored(store, key.id, response_id)
    if stored is None:
        raise not_found(response_id)
    return stored


async def delete(store: ResponseStore, key: KeyRecord, response_id: str) -> dict[str, Any]:
    try:
        deleted = await store.delete(key.id, response_id)
    except RedisError:
        raise _store_unavailable("changed") from None
    if not deleted:
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _store_unavailable(what: str) -> OpenAIError:
    return OpenAIError(
        503,
        f"Stored responses cannot be {what} right now. Please retry shortly.",
        code="store_unavailable",
        headers={"retry-after": "1"},
    )
