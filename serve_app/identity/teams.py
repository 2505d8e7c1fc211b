"""Teams: the level above API keys. A company's gateway serves many teams; each key
belongs to at most one. A team has the limits a key has (``KeyLimits``: requests
and tokens per minute, concurrency, token and money budgets, allowed models) and a
default tier for the keys made in it; a key's effective rights are the
intersection of its own and its team's.

Two levels (team → key) and no organization above: one gateway is one
organization (its admins, its prices, its Redis), and a project below a team is a
key or a few keys. Admission checks every level of a request at once
(admission/gatekeeper.py: each level's script in the same round trip, one slot per level, the
admitted ones released when another refuses), so no level is ever exceeded; see
docs/quotas.md, "Teams".

A team's record has a key record's shape (``TeamRecord`` is admitted exactly as a
key is: admission.py takes either), under ``team_record(id)``; its id starts
with "t".
"""

from __future__ import annotations

import builtins
import secrets
import time
from typing import Any

from serve_app.identity.keys import KeyRecord
from serve_app.limits import KeyLimits
from serve_app.redis_store import redis_names
from serve_app.redis_store.redis_client import as_text

TEAM_ID_PREFIX = "t"


class TeamRecord(KeyRecord):
    """A team: its limits, name and state. ``priority`` is the tier its new keys get
    when they name none; ``team`` is always None (no level above)."""


class TeamNotFound(LookupError):
    pass


def is_team_id(account_id: str) -> bool:
    return account_id.startswith(TEAM_ID_PREFIX)


class TeamStore:
    """CRUD over team records and their member sets; ``redis`` is a ``redis.asyncio.Redis``."""

    def __init__(self, redis):
        self.redis = redis

    async def create(self, name: str, limits: KeyLimits | None = None) -> TeamRecord:
        team_id = TEAM_ID_PREFIX + secrets.token_hex(6)
        if not await self.redis.set(redis_names.team_name(name), team_id, nx=True):
            raise ValueError(f"a team named {name!r} already exists")
        record = TeamRecord(id=team_id, name=name, created_at=int(time.time()), **(limits or KeyLimits()).model_dump())
        await self.redis.set(redis_names.team_record(team_id), record.model_dump_json())
        await self.redis.sadd(redis_names.TEAM_INDEX, team_id)
        return record

    async def get(self, team_id: str) -> TeamRecord:
        raw = await self.redis.get(redis_names.team_record(team_id))
        if raw is None:
            raise TeamNotFound(team_id)
        return TeamRecord.model_validate_json(raw)

    async def resolve(self, id_or_name: str) -> TeamRecord:
        """A team by id, or else by name."""
        try:
            return await self.get(id_or_name)
        except TeamNotFound:
            team_id = await self.redis.get(redis_names.team_name(id_or_name))
            if team_id is None:
                raise TeamNotFound(id_or_name) from None
            return await self.get(as_text(team_id))

    async def list(self) -> list[TeamRecord]:
        records = []
        for team_id in sorted(as_text(i) for i in await self.redis.smembers(redis_names.TEAM_INDEX)):
            try:
                records.append(await self.get(team_id))
            except TeamNotFound:
                continue
        return records

    async def members(self, team_id: str) -> builtins.list[str]:
        return sorted(as_text(i) for i in await self.redis.smembers(redis_names.team_members(team_id)))

    async def update(self, team_id: str, **changes: Any) -> TeamRecord:
        record = await self.get(team_id)
        updated = TeamRecord.model_validate({**record.model_dump(), **changes, "team": None})
        await self.redis.set(redis_names.team_record(team_id), updated.model_dump_json())
        return updated

    async def set_membership(self, key_id: str, old_team: str | None, new_team: str | None) -> None:
        """Keep the member sets in step with a key's ``team`` (the key record is what
        admission reads; these sets are for listing a team's keys)."""
        if old_team is not None:
            await self.redis.srem(redis_names.team_members(old_team), key_id)
        if new_team is not None:
            await self.redis.sadd(redis_names.team_members(new_team), key_id)
