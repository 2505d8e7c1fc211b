"""Admin credentials, one per person or service, so the audit trail names who did
what. Stored as API keys are: Redis holds the SHA-256 digest of the secret, mapped
to the admin's name, and the plain secret exists once, in ``create``'s return value.
The shared ``admin_token`` stays as the bootstrap (it can make the first named
admins); an API key never works as an admin credential, nor one of these as an API
key (each is looked up only in its own digest map)."""

from __future__ import annotations

import re
import secrets
import time

from pydantic import BaseModel

from serve_app.identity.keys import digest
from serve_app.redis_store import redis_names
from serve_app.redis_store.redis_client import as_text

SECRET_PREFIX = "sk-admin-"
# Who an admin API call authenticated with the shared admin token is (the audit trail's actor).
ADMIN_TOKEN_ACTOR = "admin-token"
SESSION_S = 8 * 3600  # an operator console session lasts a working day
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}")


class AdminRecord(BaseModel):
    name: str
    created_at: int
    created_by: str  # the actor who made it (audit.py's names)


class AdminNotFound(LookupError):
    pass


class AdminStore:
    def __init__(self, redis):
        self.redis = redis

    async def create(self, name: str, created_by: str) -> tuple[AdminRecord, str]:
        """A new admin credential; its record and the plain secret (shown once)."""
        if not NAME.fullmatch(name):
            raise ValueError("an admin's name is 1-64 letters, digits and . _ @ + - (an email address fits)")
        record = AdminRecord(name=name, created_at=int(time.time()), created_by=created_by)
        if not await self.redis.set(redis_names.admin_record(name), record.model_dump_json(), nx=True):
            raise FileExistsError(f"an admin named {name!r} already exists")
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(redis_names.admin_secret_digest(name), digest(secret))
            pipe.set(redis_names.admin_digest(digest(secret)), name)
            pipe.sadd(redis_names.ADMIN_INDEX, name)
            await pipe.execute()
        return record, secret

    async def authenticate(self, secret: str) -> AdminRecord | None:
        name = await self.redis.get(redis_names.admin_digest(digest(secret)))
        if name is None:
            return None
        try:
            return await self.get(as_text(name))
        except AdminNotFound:
            return None

    async def get(self, name: str) -> AdminRecord:
        raw = await self.redis.get(redis_names.admin_record(name))
        if raw is None:
            raise AdminNotFound(name)
        return AdminRecord.model_validate_json(raw)

    async def list(self) -> list[AdminRecord]:
        records = []
        for name in sorted(as_text(n) for n in await self.redis.smembers(redis_names.ADMIN_INDEX)):
            try:
                records.append(await self.get(name))
            except AdminNotFound:
                continue
        return records

    async def revoke(self, name: str) -> AdminRecord:
        """The credential stops working at once (no cache holds it)."""
        record = await self.get(name)
        stored = await self.redis.get(redis_names.admin_secret_digest(name))
        if stored is not None:
            await self.redis.delete(redis_names.admin_digest(as_text(stored)))
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(redis_names.admin_record(name))
            pipe.delete(redis_names.admin_secret_digest(name))
            pipe.srem(redis_names.ADMIN_INDEX, name)
            await pipe.execute()
        return record

    # -- operator console sessions (serve_app/http/console.py) ----------------------

    async def open_session(self, actor: str) -> str:
        """A session for ``actor`` (as Authenticator.admin_actor names it); its token goes in a
        cookie, its digest in Redis, expiring after ``SESSION_S``."""
        token = secrets.token_urlsafe(32)
        await self.redis.set(redis_names.console_session(digest(token)), actor, ex=SESSION_S)
        return token

    async def session_actor(self, token: str) -> str | None:
        """Who a session acts for, or None (unknown, expired, or its named admin revoked)."""
        actor = await self.redis.get(redis_names.console_session(digest(token)))
        if actor is None:
            return None
        actor = as_text(actor)
        if actor.startswith("admin:"):
            try:
                await self.get(actor.removeprefix("admin:"))
            except AdminNotFound:
                return None
        return actor

    async def close_session(self, token: str) -> None:
        await self.redis.delete(redis_names.console_session(digest(token)))
