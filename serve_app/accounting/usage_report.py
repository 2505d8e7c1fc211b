"""Usage in the shape of OpenAI's organization Usage API (``GET
/v1/organization/usage/completions``), so the tools that read OpenAI's read ours:
one-day buckets of what each key was charged per model, summed from the per-model
day counters that settlement writes (lua/settle.lua, and admit.lua for a request
whose ingress died), kept 35 days as the key's other day counters are.

What a result counts: each request of a model that was charged anything, with its
real ``input_tokens``/``output_tokens``; a request whose usage was never reported
(a stream the client cancelled, one whose ingress died) was charged its
reservation, reported apart as ``reserved_tokens`` (our field; OpenAI has none), so
a day's ``input_tokens + output_tokens + reserved_tokens`` is what its keys were
charged for inference. ``input_cached_tokens``: the part of ``input_tokens`` the
engine found in its prefix cache (a model's ``cached_prompt_per_million`` prices it).

A team is OpenAI's project here: ``project_id`` is the team the key was in when
each request was admitted and charged (null for a key with none), to group by
(``group_by=project_id``) or select (``project_ids``): a key moved to another team
leaves its earlier usage with the team that paid for it. (Counters written before
requests kept their team, and those of requests admitted while Redis was
unreachable, count under the key's team of now.)"""

from __future__ import annotations

import datetime
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import QueryParams

from serve_app.accounting.costs import NANOS_PER_USD
from serve_app.errors import OpenAIError
from serve_app.identity.keys import KeyRecord
from serve_app.redis_store import redis_names
from serve_app.redis_store.redis_client import as_text

DAY_S = 86400
DEFAULT_BUCKETS, MAX_BUCKETS = 7, 31  # OpenAI's for 1d buckets
# The longest range a query may span: past what any counter is kept (35 days of day
# counters, 13 months of month counters), a range is a client's mistake.
MAX_RANGE_DAYS = 400
GROUPS = ("project_id", "api_key_id", "model")  # what a usage result may be grouped by here
COST_GROUPS = ("project_id", "api_key_id", "line_item")  # and a cost result (a line item: "<model>, input")
COST_PARTS = ("input", "output", "reserved")
COUNTERS = (
    "requests",
    "input_tokens",
    "input_cached_tokens",
    "output_tokens",
    "reserved_tokens",
    *(f"cost_{part}_nanos" for part in COST_PARTS),
)


@dataclass(frozen=True)
class UsageQuery:
    start_time: int
    end_time: int | None = None
    group_by: tuple[str, ...] = ()
    api_key_ids: frozenset[str] | None = None
    models: frozenset[str] | None = None
    project_ids: frozenset[str] | None = None  # teams
    limit: int = DEFAULT_BUCKETS
    page: int | None = None  # the first bucket's start (a next_page cursor)


# The last second a day bucket can name: a day's Redis field is written from its date, and
# Python's dates end with the year 9999 (later times were a 500).
LAST_TIME = int(datetime.datetime(9999, 12, 30, tzinfo=datetime.UTC).timestamp())


def parse_query(params: QueryParams, groups: tuple[str, ...] = GROUPS) -> UsageQuery:
    """The query of OpenAI's usage (or, with ``COST_GROUPS``, costs) endpoint; a 400
    names the parameter it cannot take."""

    def many(name: str) -> list[str]:
        values = [*params.getlist(name), *params.getlist(name + "[]")]
        return [part for value in values for part in value.split(",") if part]

    def one(name: str) -> str | None:
        values = many(name)
        if len(values) > 1:
            raise OpenAIError(400, f"'{name}' takes one value.", param=name)
        return values[0] if values else None

    def integer(name: str, low: int, high: int) -> int | None:
        value = one(name)
        if value is None:
            return None
        # ASCII digits only (str.isdigit takes '²', which int() refuses), and few of them.
        if not (value.isascii() and value.isdigit() and len(value) <= 15) or not low <= int(value) <= high:
            raise OpenAIError(400, f"'{name}' must be an integer from {low} to {high}.", param=name)
        return int(value)

    start_time = integer("start_time", 0, LAST_TIME)
    if start_time is None:
        raise OpenAIError(400, "'start_time' (Unix seconds) is required.", param="start_time")
    end_time = integer("end_time", start_time + 1, LAST_TIME)
    if end_time is not None and end_time - start_time > MAX_RANGE_DAYS * DAY_S:
        raise OpenAIError(
            400,
            f"The range from 'start_time' to 'end_time' spans more than {MAX_RANGE_DAYS} days; "
            "usage is kept 35 days. Ask for a shorter range.",
            param="end_time",
        )
    width = one("bucket_width") or "1d"
    if width != "1d":
        raise OpenAIError(
            400, f"bucket_width '{width}' is not served here: usage is counted per day ('1d').", param="bucket_width"
        )
    group_by = tuple(dict.fromkeys(many("group_by")))
    unknown = [name for name in group_by if name not in groups]
    if unknown:
        raise OpenAIError(400, f"group_by {unknown} is not served here; group by {list(groups)}.", param="group_by")
    limit = integer("limit", 1, MAX_BUCKETS) or DEFAULT_BUCKETS
    page = integer("page", 0, LAST_TIME)
    keys, models, projects = many("api_key_ids"), many("models"), many("project_ids")
    return UsageQuery(
        start_time,
        end_time,
        group_by,
        frozenset(keys) if keys else None,
        frozenset(models) if models else None,
        frozenset(projects) if projects else None,
        limit,
        page,
    )


async def completions_usage(
    redis, keys: list[KeyRecord], query: UsageQuery, now: float | None = None
) -> dict[str, Any]:
    """OpenAI's ``page`` of ``bucket``s of ``organization.usage.completions.result``."""
    shown, more, rows = await _rows(redis, keys, query, now)
    sums: dict[int, dict[tuple, dict[str, int]]] = {
        day: defaultdict(lambda: dict.fromkeys(COUNTERS, 0)) for day in shown
    }
    for day, key_id, team, model, counter, value in rows:
        by = {"project_id": team, "api_key_id": key_id, "model": model}
        group = tuple((name, by[name]) for name in query.group_by)
        sums[day][group][counter] += value
    return _page(
        shown, more, {day: [_result(dict(group), counts) for group, counts in _sorted(sums[day])] for day in shown}
    )


async def costs(redis, keys: list[KeyRecord], query: UsageQuery, now: float | None = None) -> dict[str, Any]:
    """OpenAI's Costs API (``organization.costs.result`` buckets), in US dollars: what
    settlement priced at each model's ``pricing``; a line item is ``"<model>, input"``,
    ``"<model>, output"`` or ``"<model>, reserved"`` (usage never reported)."""
    shown, more, rows = await _rows(redis, keys, query, now)
    sums: dict[int, dict[tuple, int]] = {day: defaultdict(int) for day in shown}
    for day, key_id, team, model, counter, value in rows:
        if not counter.startswith("cost_"):
            continue
        part = counter.removeprefix("cost_").removesuffix("_nanos")
        by = {"project_id": team, "api_key_id": key_id, "line_item": f"{model}, {part}"}
        group = tuple((name, by[name]) for name in query.group_by)
        sums[day][group] += value
    return _page(
        shown, more, {day: [_cost_result(dict(group), nanos) for group, nanos in _sorted(sums[day])] for day in shown}
    )


def _sorted(groups: dict[tuple, Any]) -> list[tuple[tuple, Any]]:
    """Groups in a stable order (a key without a team groups under None)."""
    return sorted(groups.items(), key=lambda item: tuple((name, value or "") for name, value in item[0]))


async def _rows(redis, keys: list[KeyRecord], query: UsageQuery, now: float | None):
    """The days of this page, whether more follow, and every per-model counter of
    those days the query selects: (day start, key id, its team, model, counter, value)."""
    now = now if now is not None else datetime.datetime.now(datetime.UTC).timestamp()
    first = (query.page if query.page is not None else query.start_time) // DAY_S * DAY_S
    end = query.end_time if query.end_time is not None else int(now) + 1
    # This page's days and the next page's first, never the whole range as a list.
    shown = list(range(first, min(end, first + query.limit * DAY_S), DAY_S))
    more = [first + query.limit * DAY_S] if first + query.limit * DAY_S < end else []
    wanted = {_day_field(day): day for day in shown}
    rows = []
    for key in keys:
        if query.api_key_ids is not None and key.id not in query.api_key_ids:
            continue
        for field, value in (await redis.hgetall(redis_names.usage(key.id))).items():
            parsed = _model_counter(as_text(field))
            if parsed is None or parsed[0] not in wanted:
                continue
            day_field, team, model, counter = parsed
            team = team if team is not None else key.team
            if query.project_ids is not None and team not in query.project_ids:
                continue
            if query.models is None or model in query.models:
                rows.append((wanted[day_field], key.id, team, model, counter, int(value)))
    return shown, more, rows


def _page(shown: list[int], more: list[int], results: dict[int, list]) -> dict[str, Any]:
    buckets = [
        {"object": "bucket", "start_time": day, "end_time": day + DAY_S, "results": results[day]} for day in shown
    ]
    return {"object": "page", "data": buckets, "has_more": bool(more), "next_page": str(more[0]) if more else None}


def _cost_result(group: dict[str, str], nanos: int) -> dict[str, Any]:
    return {
        "object": "organization.costs.result",
        "amount": {"value": nanos / NANOS_PER_USD, "currency": "usd"},
        "line_item": group.get("line_item"),
        "project_id": group.get("project_id"),
        "api_key_id": group.get("api_key_id"),
    }


def _result(group: dict[str, str], counts: dict[str, int]) -> dict[str, Any]:
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": counts["input_tokens"],
        "output_tokens": counts["output_tokens"],
        "input_cached_tokens": counts["input_cached_tokens"],  # part of input_tokens, as OpenAI counts it
        "input_audio_tokens": 0,
        "output_audio_tokens": 0,
        "num_model_requests": counts["requests"],
        "reserved_tokens": counts["reserved_tokens"],
        "project_id": group.get("project_id"),
        "user_id": None,
        "api_key_id": group.get("api_key_id"),
        "model": group.get("model"),
        "batch": None,
        "service_tier": None,
    }


def _day_field(day_start: int) -> str:
    return datetime.datetime.fromtimestamp(day_start, datetime.UTC).strftime("d:%Y%m%d")


def _model_counter(field: str) -> tuple[str, str | None, str, str] | None:
    """``d:YYYYMMDD[:team:<team id>]:model:<model>:<counter>`` (settle.lua) → (``d:YYYYMMDD``,
    the team charged or None when the counter names none, model, counter)."""
    day, team, rest = field[:10], None, field[10:]
    if not field.startswith("d:"):
        return None
    if rest.startswith(":team:"):
        team, sep, rest = rest[6:].partition(":")
        rest = sep + rest
    if not rest.startswith(":model:") or not team and team is not None:
        return None
    model, _, counter = rest[7:].rpartition(":")
    return (day, team, model, counter) if model and counter in COUNTERS else None
