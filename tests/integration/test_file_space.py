"""A key's file storage bound against a real Redis (one node, a cluster, Sentinel):
what a hostile key can put on the disk every key shares, uploading one file at a
time or many at once, and that a delete, a failed upload or an expiry gives the
room back."""

from __future__ import annotations

import asyncio
import io
import time

import pytest

from serve_app.errors import OpenAIError
from serve_app.redis_store import redis_names
from serve_app.stored.files_api import FileStore

KEY = "k-files"


def store(tmp_path, redis, key_bytes: int, key_files: int = 100, file_bytes: int = 1000) -> FileStore:
    return FileStore(redis, str(tmp_path), max_bytes=file_bytes, max_key_bytes=key_bytes, max_key_files=key_files)


async def upload(files: FileStore, content: bytes, declared: int | None = None) -> dict:
    async with files.reservation(KEY, len(content) + 200 if declared is None else declared) as file_id:
        return await files.upload(KEY, file_id, "f.jsonl", "batch", io.BytesIO(content))


def on_disk(tmp_path) -> list:
    folder = tmp_path / KEY
    return sorted(folder.iterdir()) if folder.exists() else []


async def test_an_upload_past_the_keys_bytes_is_refused_before_a_byte_is_written_and_a_delete_makes_room(
    tmp_path, redis
):
    files = store(tmp_path, redis, key_bytes=3000)
    kept = [await upload(files, b"x" * 800) for _ in range(3)]  # 1,000 reserved each, 800 kept
    assert await files.space.used(KEY) == (2400, 3)
    with pytest.raises(OpenAIError) as refused:
        await upload(files, b"x" * 800)  # 2,400 + 1,000 declared > 3,000
    assert refused.value.status == 400 and refused.value.code == "file_storage_limit_exceeded"
    assert "2400 bytes in 3 objects" in refused.value.message and refused.value.param == "file"
    assert len(on_disk(tmp_path)) == 3 and await files.space.used(KEY) == (2400, 3)  # nothing written or held
    await upload(files, b"x" * 400)  # a smaller one still fits: 2,400 + 600 declared
    assert await files.space.used(KEY) == (2800, 4)
    with pytest.raises(OpenAIError):
        await upload(files, b"x" * 100)
    await files.delete(KEY, kept[0]["id"])
    assert await files.space.used(KEY) == (2000, 3)
    await upload(files, b"x" * 500)
    assert len(on_disk(tmp_path)) == 4 and await files.space.used(KEY) == (2500, 4)
    for name in (redis_names.file_space(KEY), redis_names.file_space_expiry(KEY)):  # bounded: they expire too
        assert 30 * 24 * 3600 * 1000 < await redis.pttl(name) <= 31 * 24 * 3600 * 1000


async def test_a_flood_of_concurrent_uploads_never_holds_more_than_the_keys_bytes(tmp_path, redis):
    files = store(tmp_path, redis, key_bytes=5000)
    outcomes = await asyncio.gather(
        *(upload(files, b"y" * 1000, declared=1000) for _ in range(16)), return_exceptions=True
    )
    refused = [o for o in outcomes if isinstance(o, OpenAIError)]
    assert len(refused) == 11 and {o.code for o in refused} == {"file_storage_limit_exceeded"}
    assert len(on_disk(tmp_path)) == 5 and sum(p.stat().st_size for p in on_disk(tmp_path)) == 5000
    assert await files.space.used(KEY) == (5000, 5)


async def test_the_keys_file_count_is_bounded_too(tmp_path, redis):
    files = store(tmp_path, redis, key_bytes=10**9, key_files=2)
    await upload(files, b"a")
    await upload(files, b"b")
    with pytest.raises(OpenAIError) as refused:
        await upload(files, b"c")
    assert refused.value.code == "file_storage_limit_exceeded" and len(on_disk(tmp_path)) == 2


async def test_a_failed_or_abandoned_upload_gives_its_room_back(tmp_path, redis):
    files = store(tmp_path, redis, key_bytes=1000)
    with pytest.raises(OpenAIError) as too_large:
        await upload(files, b"z" * 1001, declared=1000)  # lied about its length: 413 once it passes the bound
    assert too_large.value.status == 413
    with pytest.raises(ConnectionResetError):
        async with files.reservation(KEY, 1000):
            raise ConnectionResetError  # the client went away while its body was read
    assert await files.space.used(KEY) == (0, 0) and on_disk(tmp_path) == []
    await upload(files, b"z" * 700, declared=1000)  # all of the room is there again


async def test_expired_files_stop_counting(tmp_path, redis):
    files = store(tmp_path, redis, key_bytes=1000)
    now = time.time()
    await files.space.record(KEY, "file-" + "a" * 32, 900, expires_s=now + 60, now_s=now)
    assert await files.space.used(KEY, now_s=now) == (900, 1)
    assert await files.space.used(KEY, now_s=now + 61) == (0, 0)  # its 30 days are over
    await upload(files, b"q" * 700, declared=1000)


async def test_a_batchs_results_count_but_are_never_refused(tmp_path, redis):
    files = store(tmp_path, redis, key_bytes=1000)
    await upload(files, b"i" * 800, declared=900)
    written = tmp_path / KEY / "results.partial"
    written.write_bytes(b"o" * 600)
    output = await files.adopt(KEY, written, "batch_output.jsonl", "batch_output", "file-" + "b" * 32)
    assert output["bytes"] == 600 and await files.space.used(KEY) == (1400, 2)  # past the bound: work paid for
    again = await files.adopt(KEY, written, "batch_output.jsonl", "batch_output", "file-" + "b" * 32)
    assert again == output and await files.space.used(KEY) == (1400, 2)  # a resumed finalization counts it once
    with pytest.raises(OpenAIError):
        await upload(files, b"u")
    await files.delete(KEY, output["id"])
    await upload(files, b"u", declared=200)  # 800 + 200


async def test_a_batchs_results_grow_line_by_line_and_never_past_the_keys_bytes(tmp_path, redis):
    """``grow_result``: each line's bytes are counted before it is written; many lines at
    once (a batch's requests in flight, two batches) never take the key past its bound,
    and the result file's record at the end replaces what was grown, not added to it."""
    files = store(tmp_path, redis, key_bytes=3000)
    await upload(files, b"x" * 800)  # 800 held by an upload
    grown = await asyncio.gather(*(files.grow_result(KEY, f"file-{i % 2:032d}", 100) for i in range(40)))
    assert sum(grown) == 22 and await files.space.used(KEY) == (3000, 3)  # 800 + 22 x 100, two result files
    assert not await files.grow_result(KEY, "file-" + "2" * 32, 1)  # a third result: no room
    first = f"file-{0:032d}"
    grown_first = int(await redis.hget(redis_names.file_space(KEY), first))
    await files.space.record(KEY, first, grown_first - 100, time.time() + 3600)  # as written: a line short
    assert await files.space.used(KEY) == (2900, 3)
