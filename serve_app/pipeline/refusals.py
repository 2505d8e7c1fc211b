"""Admission's refusals as the client reads them: OpenAI's 429 with the limit that
refused, what was used and when to retry (the headers are the decision's own).
The decisions are made in serve_app/admission (scripts.py in Redis, local_limits.py
during an outage) and handed back as ``Refusal`` values; only this words them, as
envoy's ratelimit service decides and its HTTP filter answers."""

from __future__ import annotations

import math

from serve_app.accounting.costs import NANOS_PER_USD
from serve_app.admission.seam import REFUSALS, Decision, Refusal
from serve_app.errors import OpenAIError
from serve_app.identity.keys import KeyRecord


def render(refused: Refusal) -> OpenAIError:
    """The 429 a refusal answers, Redis' or the local limits'. It names the level that
    refused (the API key or its team) in its message and in ``x-ratelimit-scope``."""
    if refused.decision is None:
        return local_refusal(refused.key, refused.kind, refused.retry_s)
    return refusal(
        refused.key, refused.decision, refused.reserved, refused.headers, refused.level, refused.reserved_nanos
    )


def local_refusal(key: KeyRecord, kind: str, retry_s: float) -> OpenAIError:
    """A refusal of the local limits a replica keeps while Redis is unreachable."""
    kind_type, code = REFUSALS[kind]
    return OpenAIError(
        429,
        f"Rate limit reached for {kind_type} on API key '{key.name}'. Please try again in {retry_s:.1f}s.",
        type=kind_type,
        code=code,
        headers={"retry-after": str(math.ceil(retry_s)), "retry-after-ms": str(math.ceil(retry_s * 1000))},
    )


def _usd(nanos: float) -> str:
    return f"${nanos / NANOS_PER_USD:,.6f}".rstrip("0").rstrip(".")


def refusal(
    account: KeyRecord,
    decision: Decision,
    reserved: int,
    headers: dict[str, str],
    level: str = "key",
    reserved_nanos: int = 0,
) -> OpenAIError:
    """Redis' refusal ``decision`` of ``account``: the API key, or at ``level`` "team" its
    team (a team's record carries a key's limits: identity/teams.py)."""
    kind_type, code = REFUSALS[decision.kind]
    who = f"team '{account.name}'" if level == "team" else f"API key '{account.name}'"
    if decision.kind == "revoked":  # disabled in Redis since this replica cached it
        if level == "team":
            return OpenAIError(
                401, f"The {who} of this API key is disabled or does not exist.", type=kind_type, code="team_disabled"
            )
        return OpenAIError(401, f"The {who} is disabled or does not exist.", type=kind_type, code=code)
    if decision.kind.endswith("_cost_budget"):
        budget = (
            account.daily_cost_budget_usd if decision.kind == "daily_cost_budget" else account.monthly_cost_budget_usd
        )
        budget_usd = _usd(budget * NANOS_PER_USD)  # every significant digit: $0.0005, not $0.00
        period = decision.kind.split("_")[0]
        if decision.retry_ms < 0:
            message = (
                f"Request too large for {who}: its reservation costs up to {_usd(reserved_nanos)}, more than "
                f"the whole {period} spend budget of {budget_usd}. Lower max_tokens."
            )
        else:
            message = (
                f"You exceeded the {period} spend budget of {who} ({budget_usd}; spent "
                f"{_usd(int(decision.detail))}, this request reserves {_usd(reserved_nanos)}). "
                f"It renews in {decision.retry_ms / 1000:.0f}s."
            )
        return OpenAIError(429, message, type=kind_type, code=code, headers=headers)
    limit = {
        "requests": f"{account.requests_per_minute} requests per minute",
        "tokens": f"{account.tokens_per_minute} tokens per minute",
        "tokens_too_large": f"{account.tokens_per_minute} tokens per minute",
        "concurrency": f"{account.max_concurrent} concurrent requests",
        "daily_budget": f"a daily budget of {account.daily_token_budget} tokens",
        "monthly_budget": f"a monthly budget of {account.monthly_token_budget} tokens",
    }[decision.kind]
    if decision.kind == "tokens_too_large":
        message = (
            f"Request too large for {who}: it needs up to {reserved} tokens "
            f"(prompt estimate plus max_tokens × n × prompts) and the limit is {limit}. Lower max_tokens."
        )
    elif decision.kind.endswith("_budget") and decision.retry_ms < 0:
        message = (
            f"Request too large for {who}: it needs up to {reserved} tokens "
            f"(prompt estimate plus max_tokens × n × prompts), more than its whole {limit}. Lower max_tokens."
        )
    elif decision.kind.endswith("_budget"):
        message = (
            f"You exceeded your token quota on {who} ({limit}; used {decision.detail}, "
            f"this request reserves {reserved}). It renews in {decision.retry_ms / 1000:.0f}s."
        )
    elif decision.kind == "concurrency":
        message = (
            f"Rate limit reached for concurrent requests on {who}: limit {limit}, "
            f"running {decision.detail}. Please try again when one finishes."
        )
    else:
        quota, remaining, requested = (
            (account.requests_per_minute, decision.requests_remaining, 1)
            if decision.kind == "requests"
            else (account.tokens_per_minute, decision.tokens_remaining, reserved)
        )
        message = (
            f"Rate limit reached for {kind_type} on {who}: limit {limit}, "
            f"used {quota - max(remaining, 0)}, requested {requested}. "
            f"Please try again in {decision.retry_ms / 1000:.3g}s."
        )
    return OpenAIError(429, message, type=kind_type, code=code, headers=headers)
