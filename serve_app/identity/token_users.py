"""The identity-token users the gateway has admitted (identity/jwt_auth.py), kept
so that every usage surface finds them as it finds stored keys: their usage and
records live under their ``j…`` id as a key's do under its ``k…`` id, but nothing
stores such a user, so without this the usage report, the costs, the console and
``llmctl usage`` walked only the stored keys and never counted them.

Each admission of a token user refreshes its entry (at most once a minute per
user and process, in the admission's pipeline turn: no write of its own): its
name (``jwt:<user>``), the id of the team it was admitted under, and when it was
last seen. An entry lives ``KEPT_S`` past the user's last request, a day longer
than the usage report's 35 days of day counters, so every user with a counter the
report can show is listed; the index is trimmed to that window on every write,
so it holds at most the users seen in it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from serve_app.identity.keys import KeyNotFound, KeyRecord
from serve_app.redis_store import redis_names
from serve_app.redis_store.redis_client import as_text

KEPT_S = 36 * 86400
REFRESH_S = 60.0  # a process writes a user's entry at most this often
_MAX_REMEMBERED = 100_000  # users whose last write a process remembers; past it, it forgets them all


class TokenUsers:
    def __init__(self, redis, clock: Callable[[], float] = time.time):
        self.redis = redis
        self.clock = clock
        self._written: dict[str, float] = {}

    async def seen(self, user: KeyRecord, team_id: str | None, command: Callable[..., Awaitable[Any]]) -> None:
        """Refresh ``user``'s entry through ``command`` (the admission pipeline's)."""
        now = self.clock()
        if now - self._written.get(user.id, -REFRESH_S) < REFRESH_S:
            return
        if len(self._written) >= _MAX_REMEMBERED:
            self._written.clear()
        record = redis_names.token_user(user.id)
        # Together: one pipeline turn, not one round trip each.
        await asyncio.gather(
            command("HSET", record, "name", user.name, "team", team_id or ""),
            command("EXPIRE", record, int(KEPT_S)),
            command("SET", redis_names.token_user_name(user.name), user.id, "EX", int(KEPT_S)),
            command("ZADD", redis_names.TOKEN_USER_INDEX, now, user.id),
            command("ZREMRANGEBYSCORE", redis_names.TOKEN_USER_INDEX, "-inf", now - KEPT_S),
        )
        self._written[user.id] = now

    async def list(self) -> list[KeyRecord]:
        """Every user seen within ``KEPT_S``, by id."""
        ids = await self.redis.zrangebyscore(redis_names.TOKEN_USER_INDEX, self.clock() - KEPT_S, "+inf")
        users = []
        for user_id in sorted(as_text(i) for i in ids):
            try:
                users.append(await self.get(user_id))
            except KeyNotFound:
                continue  # its entry expired between the two reads
        return users

    async def get(self, user_id: str) -> KeyRecord:
        fields = {
            as_text(k): as_text(v) for k, v in (await self.redis.hgetall(redis_names.token_user(user_id))).items()
        }
        if "name" not in fields:
            raise KeyNotFound(user_id)
        return KeyRecord(id=user_id, name=fields["name"], created_at=0, team=fields.get("team") or None)

    async def resolve(self, id_or_name: str) -> KeyRecord:
        """A user by id (``j…``) or name (``jwt:<user>``)."""
        user_id = await self.redis.get(redis_names.token_user_name(id_or_name))
        return await self.get(as_text(user_id) if user_id is not None else id_or_name)
