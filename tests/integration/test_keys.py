"""Key records against a real Redis: secrets only as digests, revocation is final."""

import pytest

from serve_app.keys import KeyLimits, KeyStore, digest


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
