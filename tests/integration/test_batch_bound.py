"""A key's batches not yet ended are bounded, against a real Redis (one node, a
cluster, Sentinel): one more is refused before its file is read, and a place comes
back when a batch ends, fails at once, or cannot be made. The runners' set of
batches is made again from the keys' places when a write to it was lost."""

from __future__ import annotations

import io
import json
import time

import pytest

from serve_app.errors import OpenAIError
from serve_app.redis_store import redis_names
from serve_app.stored.batches import BatchStore
from serve_app.stored.files_api import FileStore
from serve_app.stored.stored_responses import stored_space

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


async def runners_set(redis) -> set[str]:
    return {m.decode() for m in await redis.smembers(redis_names.ACTIVE_BATCHES)}


async def test_batches_whose_runners_entry_was_lost_are_found_again_and_dead_places_given_back(tmp_path, redis):
    """What a failover (a write the dying primary had not replicated) or an ingress
    killed mid-creation leaves, on keys spread over the cluster's slots: a batch
    runners cannot see (it would stay 'validating', or 'cancelling' once cancelled,
    forever), an ended batch still holding its key's place, a place whose creation
    never wrote its record (and the record's room still reserved). A creation still
    reading its file is left alone."""
    space = stored_space(redis, max_bytes=10**6, max_objects=100)
    files = FileStore(redis, str(tmp_path), max_bytes=10_000)
    batches = BatchStore(redis, files, max_requests=10, max_active_per_key=5, records=space)
    keys = [f"k-lost-{n}" for n in range(6)]
    made = {}
    for key in keys:
        async with files.reservation(key, 1_000) as file_id:
            stored = await files.upload(key, file_id, "in.jsonl", "batch", io.BytesIO(line("a")))
        made[key] = (await batches.create(key, body(stored["id"])))["id"]
    assert await runners_set(redis) == {f"{k}/{b}" for k, b in made.items()}
    await redis.delete(redis_names.ACTIVE_BATCHES)  # every entry lost
    await batches.cancel(keys[0], made[keys[0]])  # cancelled meanwhile: back where runners find it at once
    assert await runners_set(redis) == {f"{keys[0]}/{made[keys[0]]}"}
    await batches.transition(keys[1], made[keys[1]], "completed", ("validating",))  # ended, its place not given
    now = time.time()
    await redis.zadd(redis_names.active_batches_of(keys[2]), {"batch_dead": now - 601})  # its ingress died
    await space.reserve(keys[2], "batch_dead", 64 * 1024, now + 3600)
    await redis.zadd(redis_names.active_batches_of(keys[3]), {"batch_reading": now - 5})  # still reading its file
    held_before = (await space.used(keys[2]))[0]

    found = await batches.reconcile(now_s=now)

    assert found == {"restored": 4, "ended": 1, "unmade": 1}
    assert await runners_set(redis) == {f"{k}/{b}" for k, b in made.items() if k != keys[1]}
    assert (await batches.get(keys[0], made[keys[0]]))["status"] == "cancelling"
    places = {k: {m.decode() for m in await redis.zrange(redis_names.active_batches_of(k), 0, -1)} for k in keys}
    assert places[keys[1]] == set()
    assert places[keys[2]] == {made[keys[2]]}
    assert places[keys[3]] == {made[keys[3]], "batch_reading"}
    assert (await space.used(keys[2]))[0] == held_before - 64 * 1024
    assert await batches.reconcile(now_s=now) == {"restored": 0, "ended": 0, "unmade": 0}  # agreed now


async def test_a_creation_that_fails_after_its_record_leaves_no_batch(tmp_path, redis, monkeypatch):
    """The client is told the creation failed (here: Redis refused the runners'
    set): no record is left listed as 'validating' with no runner to take it, and
    its place and its record's room are given back."""
    space = stored_space(redis, max_bytes=10**6, max_objects=100)
    files = FileStore(redis, str(tmp_path), max_bytes=10_000)
    batches = BatchStore(redis, files, max_requests=10, max_active_per_key=1, records=space)
    file_id = await uploaded(files, line("a"))
    real_sadd = redis.sadd

    async def refused(*args):
        raise ConnectionError("the write was lost")

    monkeypatch.setattr(redis, "sadd", refused)
    with pytest.raises(ConnectionError):
        await batches.create(KEY, body(file_id))
    monkeypatch.setattr(redis, "sadd", real_sadd)
    assert (await batches.page(KEY, limit=10, after=None))["data"] == []
    assert await redis.zcard(redis_names.active_batches_of(KEY)) == 0
    assert await space.used(KEY) == (0, 0)
    assert (await batches.create(KEY, body(file_id)))["status"] == "validating"  # its place is free
