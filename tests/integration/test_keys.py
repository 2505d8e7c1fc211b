"""Key records against a real Redis: secrets only as digests, revocation is final."""

import asyncio.streams

import pytest

from serve_app.identity.keys import KeyStore, digest
from serve_app.limits import KeyLimits


async def all_values(redis) -> bytes:
    out = b""
    async for name in redis.scan_iter():
        kind = await redis.type(name)
        if kind == b"string":
            out += name + b"=" + await redis.get(name) + b"\n"
        elif kind == b"set":
            out += name + b"=" + b",".join(await redis.smembers(name)) + b"\n"
    return out


async def test_secret_is_shown_once_and_stored_only_as_digest(redis):
    store = KeyStore(redis)
    record, secret = await store.create("team-a", KeyLimits(requests_per_minute=60))
    assert secret.startswith("sk-llm-") and len(secret) > 40
    stored = await all_values(redis)
    assert secret.encode() not in stored
    assert digest(secret).encode() in stored
    assert "secret" not in record.model_dump() and secret not in record.model_dump_json()


async def test_authenticate_resolve_update_list(redis):
    store = KeyStore(redis)
    record, secret = await store.create("team-a", KeyLimits(models=["tiny-llama"]))
    assert (await store.authenticate(secret)).id == record.id
    assert await store.authenticate(secret + "x") is None
    assert (await store.resolve("team-a")).id == record.id
    assert (await store.resolve(record.id)).name == "team-a"
    updated = await store.update("team-a", tokens_per_minute=1000)
    assert updated.tokens_per_minute == 1000 and (await store.get(record.id)).tokens_per_minute == 1000
    assert [r.name for r in await store.list()] == ["team-a"]
    assert record.allows_model("tiny-llama") and not record.allows_model("other")


async def test_names_are_unique(redis):
    store = KeyStore(redis)
    await store.create("team-a")
    with pytest.raises(ValueError):
        await store.create("team-a")


async def test_revoked_key_never_authenticates_again(redis):
    store = KeyStore(redis)
    record, secret = await store.create("team-a")
    await store.revoke("team-a")
    assert await store.authenticate(secret) is None
    await store.update(record.id, enabled=True)  # re-enabling does not bring the secret back
    assert await store.authenticate(secret) is None


async def test_disabled_key_does_not_authenticate(redis):
    store = KeyStore(redis)
    record, secret = await store.create("team-a")
    await store.update(record.id, enabled=False)
    assert await store.authenticate(secret) is None
    await store.update(record.id, enabled=True)
    assert (await store.authenticate(secret)).id == record.id


async def test_active_is_the_key_as_it_is_now_and_none_once_disabled_revoked_or_unknown(redis):
    store = KeyStore(redis)
    record, _ = await store.create("team-a", KeyLimits(tokens_per_minute=100))
    await store.update(record.id, tokens_per_minute=50)
    assert (await store.active(record.id)).tokens_per_minute == 50  # what running work goes on with
    await store.update(record.id, enabled=False)
    assert await store.active(record.id) is None
    await store.update(record.id, enabled=True)
    await store.revoke(record.id)
    assert await store.active(record.id) is None
    assert await store.active("k" + "0" * 16) is None


# -- a connection closed while in use (redis-py 8.1: redis/redis-py#4287) ------------------


def _raising_in(module_file: str, exc: BaseException):
    """An async function whose frame lies in ``module_file``, raising ``exc``: the
    shape of the failure as redis-py's own connection code raises it."""
    namespace: dict = {}
    exec(compile("async def send(*args, **kwargs):\n    raise EXC\n", module_file, "exec"), {"EXC": exc}, namespace)
    return namespace["send"]


async def test_a_write_on_a_connection_closed_meanwhile_is_a_connection_error(redis_server, monkeypatch):
    import redis.asyncio.connection
    from redis.exceptions import ConnectionError as RedisConnectionError

    from serve_app.redis_store.redis_client import connect

    client = connect(redis_server.url)
    try:
        await client.ping()
        broken = _raising_in(
            redis.asyncio.connection.__file__, AttributeError("'NoneType' object has no attribute 'writelines'")
        )
        monkeypatch.setattr(redis.asyncio.connection.AbstractConnection, "send_packed_command", broken)
        with pytest.raises(RedisConnectionError, match="closed while in use"):
            await client.get("x")
        # Under uvloop (Ray Serve's loop) the same write is a RuntimeError raised in
        # uvloop's compiled transport, called from asyncio's streams.
        uvloop_raise = _raising_in(
            "uvloop/handles/handle.pyx",
            RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed"),
        )
        namespace: dict = {"uvloop_raise": uvloop_raise}
        exec(
            compile("async def send(*args, **kwargs):\n    await uvloop_raise()\n", asyncio.streams.__file__, "exec"),
            namespace,
        )
        monkeypatch.setattr(redis.asyncio.connection.AbstractConnection, "send_packed_command", namespace["send"])
        with pytest.raises(RedisConnectionError, match="closed while in use"):
            await client.get("x")
        # The same errors from anywhere else are bugs and stay what they are.
        monkeypatch.setattr(
            redis.asyncio.connection.AbstractConnection,
            "send_packed_command",
            _raising_in(__file__, RuntimeError("a loop bug of ours")),
        )
        with pytest.raises(RuntimeError, match="a loop bug of ours"):
            await client.get("x")
        monkeypatch.setattr(
            redis.asyncio.connection.AbstractConnection,
            "send_packed_command",
            _raising_in(__file__, AttributeError("a bug of ours")),
        )
        with pytest.raises(AttributeError, match="a bug of ours"):
            await client.get("x")
    finally:
        monkeypatch.undo()
        await client.aclose()


async def test_a_pooled_connection_closed_while_idle_is_replaced_and_the_command_sent(redis_server, monkeypatch):
    # The write fails as a whole (nothing sent): once more on a new connection.
    from serve_app.redis_store import redis_client

    client = redis_client.connect(redis_server.url)
    original, failures = redis_client._send_packed, []
    uvloop_raise = _raising_in(
        "uvloop/handles/handle.pyx",
        RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed"),
    )
    namespace: dict = {"uvloop_raise": uvloop_raise}
    exec(compile("async def closed():\n    await uvloop_raise()\n", asyncio.streams.__file__, "exec"), namespace)

    async def closed_once(self, command, check_health=True):
        if not failures:
            failures.append(self)
            await namespace["closed"]()
        return await original(self, command, check_health)

    try:
        await client.set("idle", "ok")
        monkeypatch.setattr(redis_client, "_send_packed", closed_once)
        assert await client.get("idle") == b"ok"
        assert len(failures) == 1
    finally:
        monkeypatch.undo()
        await client.aclose()


async def test_priority_tiers_are_checked_and_old_records_read_as_normal(redis):
    import json

    from pydantic import ValidationError

    from serve_app.redis_store import redis_names

    store = KeyStore(redis)
    record, _ = await store.create("tiered", KeyLimits(priority="low"))
    assert (await store.get(record.id)).priority == "low"
    for odd in ("urgent", 0, None, ["high"], "HIGH"):
        with pytest.raises(ValidationError):
            await store.update("tiered", priority=odd)
    assert (await store.get(record.id)).priority == "low"  # a refused change changes nothing
    # A record written before tiers existed has no field: it is a normal key.
    stored = json.loads(await redis.get(redis_names.key_record(record.id)))
    del stored["priority"]
    await redis.set(redis_names.key_record(record.id), json.dumps(stored))
    assert (await store.get(record.id)).priority == "normal"
