"""Responses API state in Redis: what ``store`` keeps, so that a follow-up with
``previous_response_id`` works on any ingress and any replica (vLLM keeps its
own store in one process' memory, and it is off by default).

One Redis string per stored response, named per key (``redis_names``): another
key's id is simply not found. It holds the response as answered and the
conversation it answered (every input item, the history first; its own input
items apart, with ids, for ``input_items``), and expires
after ``RETENTION_S`` (OpenAI keeps stored responses 30 days). A conversation
too large to store (``MAX_STORED_BYTES``) is refused before it runs, so Redis
never holds more than that per response; and what a key stores counts in its
account (``stored_space``: bytes and objects per key, beside its batch records),
reserved before the response runs and refused, 400 ``storage_limit_exceeded``,
past either bound.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from serve_app.accounting.storage_account import StorageAccount
from serve_app.errors import OpenAIError
from serve_app.redis_store import redis_names

RETENTION_S = 30 * 24 * 3600
MAX_STORED_BYTES = 8 * 1024 * 1024  # as a request body may be


_SIZE_FIELD = '{"history_bytes": '  # how every record starts (json.dumps, key order kept)

# A reservation for a response being generated holds this long at most (its
# ingress died before storing or releasing it).
PENDING_S = 3600


def stored_space(redis, max_bytes: int, max_objects: int) -> StorageAccount:
    """What each key keeps in Redis: its stored responses and its batches' records."""
    return StorageAccount(
        redis,
        lambda key_id: [redis_names.stored_space(key_id), redis_names.stored_space_expiry(key_id)],
        max_bytes,
        max_objects,
        RETENTION_S,
        what="stored responses and batch records",
        param="store",
        code="storage_limit_exceeded",
        remedy="Delete stored responses you no longer need (DELETE /v1/responses/{id}), or send 'store': false.",
    )


class ResponseStore:
    def __init__(self, redis, space: StorageAccount):
        self.redis = redis
        self.space = space

    async def get(self, key_id: str, response_id: str) -> dict[str, Any] | None:
        raw = await self.redis.get(redis_names.stored_response(key_id, response_id))
        return json.loads(raw) if raw else None

    async def history_bytes(self, key_id: str, response_id: str) -> int | None:
        """The bytes a follow-up of ``response_id`` adds to its input (the
        conversation and the answer, as JSON), read without reading them: a record
        starts with it. None: no such response."""
        name = redis_names.stored_response(key_id, response_id)
        head = await self.redis.getrange(name, 0, len(_SIZE_FIELD) + 20)
        if not head:
            return None
        head = head.decode() if isinstance(head, bytes) else head
        digits = head[len(_SIZE_FIELD) :].partition(",")[0] if head.startswith(_SIZE_FIELD) else ""
        if digits.isascii() and digits.isdigit():
            return int(digits)
        return await self.redis.strlen(name)  # stored before records said it: at most the whole record

    async def reserve(self, key_id: str, size: int) -> str:
        """Room in the key's account for a response of up to ``size`` bytes, before
        it runs (a refusal runs nothing); the reservation's id."""
        pending = f"pending-{uuid.uuid4().hex}"
        await self.space.reserve(key_id, pending, size, time.time() + PENDING_S)
        return pending

    async def release(self, key_id: str, pending: str) -> None:
        """The response was not stored (refused, failed, the client gone): its room back."""
        await self.space.release(key_id, pending)

    async def put(
        self,
        key_id: str,
        response: dict[str, Any],
        context: list[dict],
        own: list[dict],
        pending: str,
        context_bytes: int,
    ) -> None:
        """Keep ``response``, the ``context`` it answered (history and its own input,
        as sent to the engine; ``context_bytes`` as JSON) and its own input items
        with their listed ids; what it really holds replaces its reservation
        ``pending`` in the key's account."""
        history = context_bytes + len(json.dumps(as_input(response.get("output") or [])))
        # The history's size first (``history_bytes``): a follow-up is priced and
        # admitted before the conversation is read.
        record = json.dumps({"history_bytes": history, "response": response, "context": context, "input_items": own})
        await self.redis.set(redis_names.stored_response(key_id, response["id"]), record, ex=RETENTION_S)
        await self.space.record(key_id, response["id"], len(record), time.time() + RETENTION_S)
        await self.space.release(key_id, pending)

    async def delete(self, key_id: str, response_id: str) -> bool:
        deleted = bool(await self.redis.delete(redis_names.stored_response(key_id, response_id)))
        if deleted:
            await self.space.release(key_id, response_id)
        return deleted


def not_found(response_id: str) -> OpenAIError:
    return OpenAIError(
        404, f"Response with id '{response_id}' not found.", param="response_id", code="response_not_found"
    )


def input_items(value: Any) -> list[Any]:
    """A request's ``input`` as a list of items (a string is one user message)."""
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else list(value)


def as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the next turn's input: messages and function
    calls go back as they are (the Responses API takes its own output as input)."""
    return [item for item in output if item.get("type") in ("message", "function_call", "reasoning")]


def item_list(items: list[Any], limit: int = 20, order: str = "desc", after: str | None = None) -> dict[str, Any]:
    """One page of OpenAI's ResponseItemList of a response's input items: each with
    an id (its own, or one given when stored), message text as content parts;
    ``order`` by position (OpenAI's default: newest first), ``after`` an item id."""
    ordered = [_as_resource(item) for item in (items if order == "asc" else reversed(items))]
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise OpenAIError(400, f"No input item with id '{after}' in this response.", param="after")
        start = ids.index(after) + 1
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "has_more": start + limit < len(ordered),
        "first_id": data[0]["id"] if data else "",
        "last_id": data[-1]["id"] if data else "",
    }


def with_ids(items: list[Any]) -> list[Any]:
    return [
        {"id": f"msg_{uuid.uuid4().hex}", **item} if isinstance(item, dict) and "id" not in item else item
        for item in items
    ]


def _as_resource(item: Any) -> Any:
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        return item
    content = item.get("content")
    if isinstance(content, str):
        kind = "output_text" if item.get("role") == "assistant" else "input_text"
        content = [{"type": kind, "text": content}]
    return {**item, "type": "message", "content": content, "status": item.get("status", "completed")}
