"""Teams over keys (serve_app/identity/teams.py, admission/gatekeeper.py): every level of a request
admitted at once and none ever exceeded, a refusal naming its level and leaving
nothing behind at the other, money budgets reserved and settled exactly, a key
moved between teams, a team revoked. On one node, a Redis Cluster and Sentinel
(the redis_url fixture), through the same quota services the ingress uses (http/services.py)."""

import asyncio
import datetime

import pytest

from contract.model_config import Pricing
from contract.replica_wire import Usage
from serve_app.accounting.costs import NANOS_PER_USD, Rates, reservation_nanos
from serve_app.admin import operations as admin
from serve_app.admission.seam import Refusal, Ticket
from serve_app.errors import OpenAIError
from serve_app.http.services import QuotaServices, build_quota_services
from serve_app.redis_store import redis_names
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry

ACTOR = "admin:test"


def gate(redis_url, **quota) -> QuotaServices:
    return build_quota_services(
        AppSettings(redis_url=redis_url, quota={"redis_timeout_s": 2, "key_cache_ttl_s": 0.2, **quota}),
        Telemetry(False, False),
    )


def today() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("d:%Y%m%d")


async def team_with_keys(access, team_limits: dict, key_limits: list[dict]):
    team = await admin.create_team(access.stores, {"name": f"team-{id(key_limits)}", **team_limits}, ACTOR)
    keys = []
    for i, limits in enumerate(key_limits):
        created = await admin.create_key(
            access.stores, {"name": f"{team['name']}-k{i}", "team": team["name"], **limits}, ACTOR
        )
        keys.append(await access.stores.keys.get(created["id"]))
    return await access.stores.teams.get(team["id"]), keys


async def counter(redis, account_id: str, field: str) -> int:
    return int(await redis.hget(redis_names.usage(account_id), f"{today()}:{field}") or 0)


async def drain(access):
    while access.gate._background:
        await asyncio.sleep(0.01)


async def test_two_keys_together_never_exceed_the_team_nor_their_own(redis_url, redis):
    access = gate(redis_url)
    team, (a, b) = await team_with_keys(access, {"requests_per_minute": 7}, [{"requests_per_minute": 5}] * 2)
    results = await asyncio.gather(*(access.gate.admit(k, "m", 1) for k in [a, b] * 10))
    admitted = [r for r in results if isinstance(r, Ticket)]
    refused = [r for r in results if isinstance(r, Refusal)]
    assert len(admitted) == 7  # the team's limit, exactly: no level exceeded, none under-used at the end
    per_key = {k.id: sum(t.key.id == k.id for t in admitted) for k in (a, b)}
    assert all(n <= 5 for n in per_key.values()), per_key
    team_refusals = [r for r in refused if r.level == "team"]
    assert team_refusals and all(r.key.id == team.id and r.kind == "requests" for r in team_refusals)
    assert all(r.headers["x-ratelimit-scope"] == r.level for r in refused)
    # What the counters say is what was admitted: a key's admission the team refused was taken back.
    assert await counter(redis, team.id, "requests") == 7
    for k in (a, b):
        assert await counter(redis, k.id, "requests") == per_key[k.id]
        assert await redis.zcard(redis_names.concurrency(k.id)) == per_key[k.id]
    assert await redis.zcard(redis_names.concurrency(team.id)) == 7
    for ticket in admitted:
        access.gate.settle(ticket, "completed", Usage(prompt_tokens=1, completion_tokens=0))
    await drain(access)
    for account in (team.id, a.id, b.id):
        assert await redis.zcard(redis_names.concurrency(account)) == 0
    await access.redis.aclose()


async def test_a_team_refusal_gives_the_key_back_everything_it_took(redis_url, redis):
    access = gate(redis_url)
    team, (k,) = await team_with_keys(
        access, {"max_concurrent": 1}, [{"requests_per_minute": 3, "tokens_per_minute": 300}]
    )
    first = await access.gate.admit(k, "m", 100)
    assert isinstance(first, Ticket) and first.team.id == team.id
    for _ in range(5):  # the team's one place is taken: each is refused by the team, not the key
        refused = await access.gate.admit(k, "m", 100)
        assert isinstance(refused, Refusal) and refused.level == "team" and refused.kind == "concurrency"
    assert await counter(redis, k.id, "requests") == 1
    assert await counter(redis, k.id, "tokens") == 100
    assert await counter(redis, k.id, "refused") == 5
    assert (
        len(
            [
                name
                async for name in redis.scan_iter(
                    match=redis_names.request_record_prefix(k.id) + "*", **_scan_target(redis, k.id)
                )
            ]
        )
        == 1
    )
    access.gate.settle(first, "completed", Usage(prompt_tokens=10, completion_tokens=20))
    await drain(access)
    # The key's own rate limits were never spent by the refused five: its burst of 3 is whole but one.
    results = [await access.gate.admit(k, "m", 100) for _ in range(3)]
    assert isinstance(results[0], Ticket)
    assert isinstance(results[1], Refusal) and results[1].level == "team"  # the team's one place again
    access.gate.settle(results[0], "completed", Usage(prompt_tokens=1, completion_tokens=1))
    await drain(access)
    third = await access.gate.admit(k, "m", 100)
    assert isinstance(third, Ticket)  # the key's 3rd request of its burst
    access.gate.settle(third, "completed", Usage(prompt_tokens=1, completion_tokens=1))
    await drain(access)
    refused = await access.gate.admit(k, "m", 1)
    assert isinstance(refused, Refusal) and refused.level == "key" and refused.kind == "requests"
    await access.redis.aclose()


def _scan_target(redis, account_id: str) -> dict:
    """scan_iter's target: the node of the account's slot on a cluster."""
    if hasattr(redis, "get_node_from_key"):
        return {"target_nodes": redis.get_node_from_key(redis_names.usage(account_id))}
    return {}


async def test_money_budgets_hold_the_reservation_and_settle_to_the_real_cost(redis_url, redis):
    access = gate(redis_url)
    rates = Rates.of(Pricing(prompt_per_million=1.0, completion_per_million=3.0))
    reserve = reservation_nanos(rates, 1000, 1000)  # 1,000 + 3,000 nano-dollars per million... per token
    assert reserve == 4_000_000
    budget_usd = 10 * reserve / NANOS_PER_USD  # ten reservations' worth
    team, (a, b) = await team_with_keys(
        access, {"daily_cost_budget_usd": budget_usd}, [{"daily_cost_budget_usd": 7 * reserve / NANOS_PER_USD}, {}]
    )
    results = await asyncio.gather(*(access.gate.admit(k, "m", 2000, reserve_nanos=reserve) for k in [a, b] * 8))
    admitted = [r for r in results if isinstance(r, Ticket)]
    assert len(admitted) == 10  # the team's money, exactly
    assert sum(t.key.id == a.id for t in admitted) <= 7
    kinds = {(r.level, r.kind) for r in results if isinstance(r, Refusal)}
    assert kinds <= {("team", "daily_cost_budget"), ("key", "daily_cost_budget")}, kinds
    assert await counter(redis, team.id, "cost_nanos") == 10 * reserve
    # Settled to the real cost: 100 prompt + 50 completion tokens each.
    for ticket in admitted:
        ticket.rates, ticket.reserved = rates, (1000, 1000)
        access.gate.settle(ticket, "completed", Usage(prompt_tokens=100, completion_tokens=50))
    await drain(access)
    real = 100 * 1000 + 50 * 3000
    assert await counter(redis, team.id, "cost_nanos") == 10 * real
    n_a = sum(t.key.id == a.id for t in admitted)
    assert await counter(redis, a.id, "cost_nanos") == n_a * real
    # The money given back admits more, exactly as much as fits.
    more = await asyncio.gather(*(access.gate.admit(b, "m", 2000, reserve_nanos=reserve) for _ in range(20)))
    fits = (10 * reserve - 10 * real) // reserve
    assert sum(isinstance(r, Ticket) for r in more) == fits
    await access.redis.aclose()


async def test_a_reservation_dearer_than_the_whole_budget_can_never_fit(redis_url, redis):
    access = gate(redis_url)
    team, (k,) = await team_with_keys(access, {"daily_cost_budget_usd": 0.001}, [{}])
    refused = await access.gate.admit(k, "m", 10, reserve_nanos=2_000_000)
    assert isinstance(refused, Refusal) and refused.level == "team" and refused.decision.retry_ms == -1
    assert await counter(redis, k.id, "requests") == 0 and await counter(redis, team.id, "requests") == 0
    await access.redis.aclose()


async def test_a_key_moved_between_teams_takes_the_new_teams_limits(redis_url, redis):
    access = gate(redis_url)
    strict, (k,) = await team_with_keys(access, {"requests_per_minute": 1}, [{}])
    roomy = await admin.create_team(access.stores, {"name": f"roomy-{k.id}", "requests_per_minute": 100}, ACTOR)
    assert isinstance(await access.gate.admit(k, "m", 1), Ticket)
    refused = await access.gate.admit(k, "m", 1)
    assert isinstance(refused, Refusal) and refused.level == "team"
    moved = await admin.update_key(access.stores, k.id, {"team": roomy["name"]}, ACTOR)
    assert moved["team"] == roomy["id"]
    assert (
        await access.stores.teams.members(roomy["id"]) == [k.id] and await access.stores.teams.members(strict.id) == []
    )
    k = await access.stores.keys.get(k.id)  # what the ingress reads once its cache expires
    assert all([isinstance(await access.gate.admit(k, "m", 1), Ticket) for _ in range(5)])
    assert await counter(redis, roomy["id"], "requests") == 5
    trail = (await access.stores.audit.read(10, None, None, k.id))["data"]
    assert any(entry["action"] == "key.update" and entry["after"].get("team") == roomy["id"] for entry in trail)
    await access.redis.aclose()


async def test_a_revoked_team_stops_its_keys(redis_url, redis):
    access = gate(redis_url)
    team, (k,) = await team_with_keys(access, {}, [{}])
    running = await access.gate.admit(k, "m", 1)
    assert isinstance(running, Ticket)
    await admin.revoke_team(access.stores, team.name, ACTOR)
    assert await access.stores.keys.active(k.id) is None  # running streams and batches stop at their next check
    assert await access.maintenance.stop_revoked() == 1 and running.revoked
    with pytest.raises(OpenAIError) as joining:  # no key joins a disabled team
        await admin.create_key(access.stores, {"name": f"late-{k.id}", "team": team.id}, ACTOR)
    assert joining.value.status == 400 and joining.value.code == "team_disabled"
    await asyncio.sleep(0.3)  # the team cache's TTL
    with pytest.raises(OpenAIError) as refused:
        await access.gate.admit(k, "m", 1)
    assert refused.value.status == 401 and refused.value.code == "team_disabled"
    await access.redis.aclose()


async def test_a_key_may_use_only_the_models_its_team_may(redis_url, redis):
    access = gate(redis_url)
    _, (k,) = await team_with_keys(access, {"models": ["allowed"]}, [{}])
    assert isinstance(await access.gate.admit(k, "allowed", 1), Ticket)
    with pytest.raises(OpenAIError) as refused:
        await access.gate.admit(k, "other", 1)
    assert refused.value.status == 403 and refused.value.code == "model_not_allowed"
    await access.redis.aclose()


async def test_a_new_key_takes_its_teams_tier_unless_it_names_one(redis_url, redis):
    access = gate(redis_url)
    team = await admin.create_team(access.stores, {"name": "tiered", "priority": "high"}, ACTOR)
    plain = await admin.create_key(access.stores, {"name": "tiered-plain", "team": "tiered"}, ACTOR)
    low = await admin.create_key(access.stores, {"name": "tiered-low", "team": team["id"], "priority": "low"}, ACTOR)
    assert (plain["priority"], low["priority"]) == ("high", "low")
    with pytest.raises(OpenAIError) as unknown:
        await admin.create_key(access.stores, {"name": "nowhere", "team": "no-such-team"}, ACTOR)
    assert unknown.value.status == 404 and unknown.value.param == "team"
    await access.redis.aclose()


async def test_renewal_keeps_the_teams_leases_of_running_requests(redis_url, redis):
    access = gate(redis_url, concurrency_lease_s=0.6)
    team, (k,) = await team_with_keys(access, {"max_concurrent": 1}, [{}])
    ticket = await access.gate.admit(k, "m", 1)
    for _ in range(4):  # past the lease twice over, renewed every third of it
        await asyncio.sleep(0.2)
        await access.gate.renew_leases()
    refused = await access.gate.admit(k, "m", 1)
    assert isinstance(refused, Refusal) and refused.level == "team"  # still held
    access.gate.settle(ticket, "completed", Usage(prompt_tokens=1, completion_tokens=1))
    await drain(access)
    assert isinstance(await access.gate.admit(k, "m", 1), Ticket)
    await access.redis.aclose()
