"""The soak's tenants: ``teams`` teams and ``keys`` keys over them, with mixed
limits drawn from a seed (requests/min, tokens/min, concurrency, daily token and
money budgets; some unlimited, some tight enough to be hit in minutes), made
through the admin operations as `llmctl` makes them, straight in Redis."""

from __future__ import annotations

import random
from dataclasses import dataclass

from serve_app.admin import operations
from serve_app.admin.operations import AdminStores
from soak.ledger import Limits

NANOS_PER_USD = 1_000_000_000


@dataclass
class Tenant:
    key_id: str
    secret: str
    team_id: str
    limits: Limits


def _limits(rng: random.Random, scale: int) -> Limits:
    """One account's limits; ``scale``: a team's are its keys' times this."""

    def maybe(value: int, chance: float = 0.7) -> int:
        return value * scale if rng.random() < chance else 0

    return Limits(
        requests_per_minute=maybe(rng.choice([6, 12, 30, 60, 120])),
        tokens_per_minute=maybe(rng.choice([600, 1500, 4000, 10000]), 0.6),
        max_concurrent=maybe(rng.choice([1, 2, 4, 8]), 0.6),
        daily_token_budget=maybe(rng.choice([2000, 8000, 40000]), 0.3),
        daily_cost_nanos=maybe(rng.choice([5, 20, 100]) * NANOS_PER_USD // 1000, 0.3),
    )


def as_body(limits: Limits) -> dict:
    return {
        "requests_per_minute": limits.requests_per_minute,
        "tokens_per_minute": limits.tokens_per_minute,
        "max_concurrent": limits.max_concurrent,
        "daily_token_budget": limits.daily_token_budget,
        "daily_cost_budget_usd": limits.daily_cost_nanos / NANOS_PER_USD,
    }


async def provision(stores: AdminStores, seed: int, keys: int, teams: int) -> tuple[list[Tenant], dict[str, Limits]]:
    rng = random.Random(seed)
    team_limits: dict[str, Limits] = {}
    for index in range(teams):
        limits = _limits(rng, scale=8)
        made = await operations.create_team(stores, {"name": f"soak-team-{index}", **as_body(limits)}, "soak")
        team_limits[made["id"]] = limits
    team_ids = list(team_limits)
    tenants = []
    for index in range(keys):
        limits = _limits(rng, scale=1)
        team = team_ids[index % len(team_ids)]
        made = await operations.create_key(
            stores, {"name": f"soak-key-{index}", "team": team, **as_body(limits)}, "soak"
        )
        tenants.append(Tenant(made["id"], made["secret"], team, limits))
    return tenants, team_limits
