"""The identity-token users' index (serve_app/identity/token_users.py) on a real Redis
(one node, a Cluster, a Sentinel primary): a user admitted is found by id and name
and listed; a process writes a user at most once a minute; an entry outlives the
usage report's 35 days by a day and no more, and the index never holds a user past
it; the admin operations find a user's usage as they find a key's."""

from __future__ import annotations

import pytest

from serve_app.admin import operations as admin
from serve_app.identity.keys import KeyNotFound, KeyRecord, KeyStore
from serve_app.identity.token_users import KEPT_S, TokenUsers
from serve_app.limits import KeyLimits
from serve_app.redis_store import redis_names

DAY = 86400.0


class Clock:
    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def user(sub: str, team: str | None = None) -> KeyRecord:
    return KeyRecord(id="j" + sub.encode().hex()[:16].ljust(16, "0"), name=f"jwt:{sub}", created_at=0, team=team)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def users(redis, clock):
    return TokenUsers(redis, clock=clock)


@pytest.fixture
def writes(redis):
    """The admission pipeline's ``command``, counting what it is asked."""
    sent: list[tuple] = []

    async def command(*args):
        sent.append(args)
        return await redis.execute_command(*args)

    command.sent = sent
    return command


async def test_a_user_admitted_is_found_by_id_and_name_and_listed(users, writes):
    ana, bo = user("ana@example.com"), user("bo@example.com")
    await users.seen(ana, "t0123456789ab", writes)
    await users.seen(bo, None, writes)
    for who in (ana.id, ana.name):
        found = await users.resolve(who)
        assert (found.id, found.name, found.team) == (ana.id, ana.name, "t0123456789ab")
    assert (await users.resolve(bo.name)).team is None
    assert [u.id for u in await users.list()] == sorted([ana.id, bo.id])
    with pytest.raises(KeyNotFound):
        await users.resolve("jwt:nobody@example.com")


async def test_a_process_writes_a_user_at_most_once_a_minute(users, writes, clock, redis):
    ana = user("ana@example.com")
    await users.seen(ana, None, writes)
    first = len(writes.sent)
    clock.now += 30
    await users.seen(ana, None, writes)
    assert len(writes.sent) == first  # within the minute: nothing written
    clock.now += 31
    await users.seen(ana, "t0123456789ab", writes)
    assert len(writes.sent) == 2 * first
    assert await redis.zscore(redis_names.TOKEN_USER_INDEX, ana.id) == clock.now
    assert (await users.get(ana.id)).team == "t0123456789ab"  # the team it was last admitted under


async def test_an_entry_lives_a_day_past_the_reports_35_days_and_the_index_is_trimmed(users, writes, clock, redis):
    old, new = user("old@example.com"), user("new@example.com")
    await users.seen(old, None, writes)
    assert 0 < await redis.ttl(redis_names.token_user(old.id)) <= KEPT_S
    assert KEPT_S == 36 * DAY
    clock.now += 35 * DAY
    assert [u.id for u in await users.list()] == [old.id]  # still within: its counters may be reported
    clock.now += DAY + 1
    assert await users.list() == []  # past it: not listed even while Redis keeps the entry
    await users.seen(new, None, writes)  # every write trims the index
    assert await redis.zrange(redis_names.TOKEN_USER_INDEX, 0, -1) in ([new.id], [new.id.encode()])


async def test_the_admin_operations_find_a_users_usage_as_a_keys(redis, users, writes):
    ana = user("ana@example.com")
    await users.seen(ana, None, writes)
    stored, _ = await KeyStore(redis).create("svc", KeyLimits())
    stores = admin.AdminStores.over(redis)
    assert {a.id for a in await admin.accounts(stores)} == {stored.id, ana.id}
    for who in (ana.id, ana.name):
        shown = await admin.usage(stores, who)
        assert (shown["id"], shown["key"], shown["today"]["requests"]) == (ana.id, ana.name, 0)
    assert (await admin.account(stores, "svc"))["id"] == stored.id
