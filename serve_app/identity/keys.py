"""API keys: records in Redis, secrets only as SHA-256 digests.

The plain secret exists once, in the return value of ``create``; Redis holds
its digest, mapped to the key id. Both ``llmctl keys`` and the admin API use
this store, so there is one way to manage keys.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any

from pydantic import Field

from serve_app.limits import KeyLimits
from serve_app.redis_store import redis_names

SECRET_PREFIX = "sk-llm-"


class KeyRecord(KeyLimits):
    id: str
    name: str
    enabled: bool = True
    created_at: int
    team: str | None = Field(
        None,
        description="The id of the team the key belongs to (identity/teams.py; an "
        "identity token's user: the team's name); its limits apply on "
        "top of the key's own.",
    )

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


class KeyNotFound(LookupError):
    pass


class KeyStore:
    """CRUD over key records; ``redis`` is a ``redis.asyncio.Redis``."""

    def __init__(self, redis):
        self.redis = redis

    async def create(
        self, name: str, limits: KeyLimits | None = None, secret: str | None = None
    ) -> tuple[KeyRecord, str]:
        """Create a key; return its record and the plain secret (shown once).
        ``secret`` is for the local development key only: normally one is made."""
        key_id = "k" + secrets.token_hex(6)
        if not await self.redis.set(redis_names.key_name(name), key_id, nx=True):
            raise ValueError(f"a key named {name!r} already exists")
        secret = secret or new_secret()
        record = KeyRecord(id=key_id, name=name, created_at=int(time.time()), **(limits or KeyLimits()).model_dump())
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(redis_names.key_record(key_id), record.model_dump_json())
            pipe.set(redis_names.key_secret_digest(key_id), digest(secret))
            pipe.set(redis_names.key_digest(digest(secret)), key_id)
            pipe.sadd(redis_names.KEY_INDEX, key_id)
            await pipe.execute()
        return record, secret

    async def get(self, key_id: str) -> KeyRecord:
        raw = await self.redis.get(redis_names.key_record(key_id))
        if raw is None:
            raise KeyNotFound(key_id)
        return KeyRecord.model_validate_json(raw)

    async def active(self, key_id: str) -> KeyRecord | None:
        """The key as it is now, or None once it or its team is revoked (gone) or
        disabled: what running work asks before it goes on (a batch's next request,
        a running call)."""
        try:
            key = await self.get(key_id)
        except KeyNotFound:
            return None
        if key.team is not None:
            raw = await self.redis.get(redis_names.team_record(key.team))
            if raw is None or not KeyRecord.model_validate_json(raw).enabled:
                return None
        return key if key.enabled else None

    async def resolve(self, id_or_name: str) -> KeyRecord:
        """A key by id, or else by name."""
        try:
            return await self.get(id_or_name)
        except KeyNotFound:
            key_id = await self.redis.get(redis_names.key_name(id_or_name))
            if key_id is None:
                raise KeyNotFound(id_or_name) from None
            return await self.get(_text(key_id))

    async def authenticate(self, secret: str) -> KeyRecord | None:
        """The enabled key this secret belongs to, or None."""
        key_id = await self.redis.get(redis_names.key_digest(digest(secret)))
        if key_id is None:
            return None
        try:
            record = await self.get(_text(key_id))
        except KeyNotFound:
            return None
        return record if record.enabled else None

    async def list(self) -> list[KeyRecord]:
        ids = sorted(_text(i) for i in await self.redis.smembers(redis_names.KEY_INDEX))
        records = []
        for key_id in ids:
            try:
                records.append(await self.get(key_id))
            except KeyNotFound:
                continue
        return records

    async def update(self, id_or_name: str, **changes: Any) -> KeyRecord:
        record = await self.resolve(id_or_name)
        updated = KeyRecord.model_validate({**record.model_dump(), **changes})
        await self.redis.set(redis_names.key_record(record.id), updated.model_dump_json())
        return updated

    async def revoke(self, id_or_name: str) -> KeyRecord:
        """Disable the key and forget its secret: it can never authenticate again."""
        record = await self.update(id_or_name, enabled=False)
        stored = await self.redis.get(redis_names.key_secret_digest(record.id))
        if stored is not None:
            await self.redis.delete(redis_names.key_digest(_text(stored)))
        return record


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
