"""A key's batches not yet ended are bounded, against a real Redis (one node, a
cluster, Sentinel): one more is refused before its file is read, and a place comes
back when a batch ends, fails at once, or cannot be made."""

from __future__ import annotations

import io
import json
import time

import pytest

from serve_app.errors import OpenAIError
from serve_app.redis_store import redis_names
from serve_app.stored.batches import BatchStore
from serve_app.stored.files_api import FileStore

KEY = "k-batches"


def line(custom_id: str, url: str = "/v1/chat/completions") -> bytes:
    return (
        json.dumps(
            {
                "custom_id": custom_id,
                "method": "POST",
                "url": url,
                "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            }
        )
        + "\n"
    ).encode()


async def uploaded(files: FileStore, content: bytes) -> str:
    async with files.reservation(KEY, len(content) + 200) as file_id:
        return (await files.upload(KEY, file_id, "in.jsonl", "batch", io.BytesIO(content)))["id"]


def body(file_id: str) -> dict:
    return {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}


async def test_one_batch_past_the_keys_bound_is_refused_and_an_ended_one_makes_room(tmp_path, redis):
    files = FileStore(redis, str(tmp_path), max_bytes=10_000)
    batches = BatchStore(redis, files, max_requests=10, max_active_per_key=2)
    good = await uploaded(files, line("a") + line("b"))
    first = await batches.create(KEY, body(good))
    await batches.create(KEY, body(good))
    with pytest.raises(OpenAIError) as refused:
        await batches.create(KEY, body(good))
    assert refused.value.status == 429 and refused.value.code == "too_many_active_batches"
    assert (await batches.page(KEY, limit=10, after=None))["data"].__len__() == 2  # nothing made of it
    # Neither a batch that fails at once, nor one that cannot be made, keeps a place.
    await batches.ended(KEY, first["id"])
    wrong_endpoint = await uploaded(files, line("c", url="/v1/embeddings"))
    assert (await batches.create(KEY, body(wrong_endpoint)))["status"] == "failed"
    not_a_batch = await uploaded(files, b"not json\n")
    with pytest.raises(OpenAIError) as bad:
        await batches.create(KEY, body(not_a_batch))
    assert bad.value.status == 400
    third = await batches.create(KEY, body(good))  # the place the ended one left
    assert third["status"] == "validating"
    assert await redis.zcard(redis_names.active_batches_of(KEY)) == 2


async def test_a_place_whose_ending_was_lost_is_forgotten_after_the_window(tmp_path, redis):
    files = FileStore(redis, str(tmp_path), max_bytes=10_000)
    batches = BatchStore(redis, files, max_requests=10, max_active_per_key=1)
    stale = time.time() - 49 * 3600  # past the 24 h window and a day more: its runner would have ended it
    await redis.zadd(redis_names.active_batches_of(KEY), {"batch_lost": stale})
    created = await batches.create(KEY, body(await uploaded(files, line("a"))))
    assert created["status"] == "validating"
    assert [m.decode() for m in await redis.zrange(redis_names.active_batches_of(KEY), 0, -1)] == [created["id"]]
