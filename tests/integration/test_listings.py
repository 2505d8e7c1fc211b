"""Listing a key's files and batches against a real Redis (one node, a cluster,
Sentinel): pages follow the ``after`` cursor in either order, entries whose record
expired leave the index as they are met, a purpose filter reads on past them, a
page reads a bounded part of the index, and the indexes expire."""

from __future__ import annotations

import io
import json

from serve_app.redis_store import redis_names
from serve_app.stored.batches import BatchStore
from serve_app.stored.files_api import FileStore

KEY = "k-listings"


async def stored_files(files: FileStore, count: int, purpose: str = "batch") -> list[str]:
    ids = []
    for _ in range(count):
        async with files.reservation(KEY, 100) as file_id:
            ids.append((await files.upload(KEY, file_id, "in.jsonl", purpose, io.BytesIO(b"{}\n")))["id"])
    return ids


async def test_files_page_by_the_cursor_in_either_order_and_forget_what_expired(tmp_path, redis):
    files = FileStore(redis, str(tmp_path), max_bytes=10_000)
    ids = await stored_files(files, 7)
    await redis.delete(redis_names.file_record(KEY, ids[3]))  # expired: its index entry is left
    newest_first = [i for i in reversed(ids) if i != ids[3]]
    pages, after = [], None
    while True:
        page = await files.page(KEY, None, limit=2, order="desc", after=after)
        pages.append([record["id"] for record in page["data"]])
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert [i for page in pages for i in page] == newest_first and all(len(p) == 2 for p in pages[:-1])
    assert await redis.zscore(redis_names.file_index(KEY), ids[3]) is None  # forgotten as it was met
    ascending = await files.page(KEY, None, limit=10, order="asc", after=ids[1])
    assert [record["id"] for record in ascending["data"]] == [ids[2], *ids[4:]] and not ascending["has_more"]
    assert (await files.page(KEY, None, limit=5, order="desc", after="file-" + "0" * 32))["data"] == []
    assert 0 < await redis.ttl(redis_names.file_index(KEY)) <= 30 * 24 * 3600


async def test_a_purpose_filter_reads_on_past_the_others(tmp_path, redis):
    files = FileStore(redis, str(tmp_path), max_bytes=10_000)
    outputs = await stored_files(files, 2, purpose="batch_output")
    await stored_files(files, 5)  # newer, of the other purpose
    page = await files.page(KEY, "batch_output", limit=1, order="desc", after=None)
    assert [record["id"] for record in page["data"]] == [outputs[1]] and page["has_more"]
    rest = await files.page(KEY, "batch_output", limit=1, order="desc", after=page["last_id"])
    assert [record["id"] for record in rest["data"]] == [outputs[0]] and not rest["has_more"]


async def test_batches_page_newest_first_and_their_index_expires(tmp_path, redis):
    files = FileStore(redis, str(tmp_path), max_bytes=10_000)
    batches = BatchStore(redis, files, max_requests=10, max_active_per_key=10)
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    async with files.reservation(KEY, 1000) as file_id:
        await files.upload(KEY, file_id, "in.jsonl", "batch", io.BytesIO(json.dumps(line).encode() + b"\n"))
    made = [
        (
            await batches.create(
                KEY, {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
            )
        )["id"]
        for _ in range(3)
    ]
    first = await batches.page(KEY, limit=2, after=None)
    second = await batches.page(KEY, limit=2, after=first["last_id"])
    assert [b["id"] for b in first["data"] + second["data"]] == made[::-1]
    assert first["has_more"] and not second["has_more"]
    assert 0 < await redis.ttl(redis_names.batch_index(KEY)) <= 32 * 24 * 3600
