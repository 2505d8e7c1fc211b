"""The usage API in OpenAI's shape (serve_app/accounting/usage_report.py) on a real Redis
(one node, a Cluster, Sentinel): what settlement counts per model and day, that the
sums equal what the request records say was charged, the wire format against
OpenAI's spec, and the queries a hostile admin tool might send."""

from __future__ import annotations

import asyncio
import time

import openai_spec
import pytest
from starlette.datastructures import QueryParams

from contract.model_config import Pricing
from contract.replica_wire import Usage
from serve_app.accounting.costs import Cost, Rates
from serve_app.accounting.usage_report import COST_GROUPS, LAST_TIME, completions_usage, costs, parse_query
from serve_app.admission.scripts import AdmissionScripts
from serve_app.errors import OpenAIError
from serve_app.http.services import build_quota_services
from serve_app.identity.keys import KeyRecord
from serve_app.redis_store import redis_names
from serve_app.redis_store.redis_client import as_text
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry

_ids = iter(range(10**9))


def today() -> int:
    """Today's start (UTC), read when asked: a suite may run across midnight."""
    return int(time.time()) // 86400 * 86400


def key(key_id: str) -> KeyRecord:
    return KeyRecord(id=key_id, name=key_id, created_at=0)


async def run(adm: AdmissionScripts, k: KeyRecord, model: str, reserve: int, status: str, prompt: int, completion: int):
    rid = f"{k.id}-{next(_ids):016x}"
    assert (await adm.admit(k, rid, model, reserve)).admitted
    await adm.settle(k, rid, status, prompt, completion, "r1", model)
    return rid


def query(**params) -> QueryParams:
    return QueryParams(
        [(name, str(v)) for name, values in params.items() for v in (values if isinstance(values, list) else [values])]
    )


async def test_each_charged_request_counts_once_per_model_and_the_sums_are_what_was_charged(redis):
    adm = AdmissionScripts(redis, lease_s=0.3, retention_s=3600)
    a, b = key("kusagea"), key("kusageb")
    await run(adm, a, "chat", 50, "completed", 12, 30)
    await run(adm, a, "chat", 50, "completed", 8, 2)
    await run(adm, a, "embed", 20, "completed", 9, 0)
    await run(adm, a, "chat", 40, "cancelled", -1, -1)  # usage never reported: its reservation is charged
    await run(adm, a, "chat", 40, "overloaded", 0, 0)  # refused by the model's queue: charged nothing
    await run(adm, a, "", 0, "completed", 0, 0)  # a Files/Batch route: no model, no inference
    await run(adm, b, "chat", 10, "completed", 3, 4)
    # A request whose ingress died: its lease expires and the reaper finalises it.
    rid = f"{b.id}-{next(_ids):016x}"
    assert (await adm.admit(b, rid, "chat", 25)).admitted
    await asyncio.sleep(0.4)
    await adm.reap(b.id)
    await run(adm, b, "embed", 5, "completed", 5, 0)
    # Admitted without Redis (an outage): only its settlement reaches Redis.
    await adm.settle(b, f"{b.id}-{next(_ids):016x}", "completed", 6, 1, "r1", "chat")

    page = await completions_usage(
        redis, [a, b], parse_query(query(start_time=today(), group_by=["api_key_id", "model"]))
    )
    openai_spec.validate(page, "UsageResponse")
    [bucket] = page["data"]
    assert (bucket["start_time"], bucket["end_time"], page["has_more"]) == (today(), today() + 86400, False)
    got = {
        (r["api_key_id"], r["model"]): (
            r["num_model_requests"],
            r["input_tokens"],
            r["output_tokens"],
            r["reserved_tokens"],
        )
        for r in bucket["results"]
    }
    assert got == {
        ("kusagea", "chat"): (3, 20, 32, 40),
        ("kusagea", "embed"): (1, 9, 0, 0),
        ("kusageb", "chat"): (3, 9, 5, 25),
        ("kusageb", "embed"): (1, 5, 0, 0),
    }
    # What each key was charged today, by its own counter and by its records, is the sum.
    day = time.strftime("d:%Y%m%d", time.gmtime())
    for k in (a, b):
        charged = int(await redis.hget(redis_names.usage(k.id), f"{day}:tokens"))
        mine = [r for r in bucket["results"] if r["api_key_id"] == k.id]
        assert charged == sum(r["input_tokens"] + r["output_tokens"] + r["reserved_tokens"] for r in mine)

    by_model = await completions_usage(
        redis, [a, b], parse_query(query(start_time=today(), group_by="model", models="chat"))
    )
    assert [(r["model"], r["api_key_id"], r["num_model_requests"]) for r in by_model["data"][0]["results"]] == [
        ("chat", None, 6)
    ]
    only_b = await completions_usage(redis, [a, b], parse_query(query(start_time=today(), api_key_ids=b.id)))
    [total] = only_b["data"][0]["results"]
    assert (total["num_model_requests"], total["input_tokens"], total["model"]) == (4, 14, None)


async def test_teams_are_projects_grouped_and_selected_by_project_id(redis):
    adm = AdmissionScripts(redis, lease_s=60, retention_s=3600)
    eng1, eng2, solo = (
        KeyRecord(id=i, name=i, created_at=0, team=t)
        for i, t in (("kteam1", "teng"), ("kteam2", "teng"), ("ksolo", None))
    )
    await run(adm, eng1, "chat", 50, "completed", 10, 20)
    await run(adm, eng2, "chat", 50, "completed", 1, 2)
    await run(adm, solo, "chat", 50, "completed", 100, 200)
    page = await completions_usage(
        redis, [eng1, eng2, solo], parse_query(query(start_time=today(), group_by="project_id"))
    )
    openai_spec.validate(page, "UsageResponse")
    got = {
        r["project_id"]: (r["num_model_requests"], r["input_tokens"], r["output_tokens"])
        for r in page["data"][0]["results"]
    }
    assert got == {"teng": (2, 11, 22), None: (1, 100, 200)}
    only = await completions_usage(
        redis, [eng1, eng2, solo], parse_query(query(start_time=today(), project_ids="teng"))
    )
    [total] = only["data"][0]["results"]
    assert (total["num_model_requests"], total["input_tokens"], total["project_id"]) == (2, 11, None)


async def test_usage_stays_with_the_team_it_was_charged_to_when_its_key_moves(redis):
    """A key of team X spends, moves to team Y, spends again: X's usage and costs are
    what it paid for, Y's its own; the key's counters written before teams were kept
    in them count under its team of now."""
    adm = AdmissionScripts(redis, lease_s=60, retention_s=3600)
    in_x = KeyRecord(id="kmover", name="mover", created_at=0, team="tmoverx")
    in_y = in_x.model_copy(update={"team": "tmovery"})
    for k, team, prompt in ((in_x, "tmoverx", 198), (in_y, "tmovery", 7)):
        rid = f"{k.id}-{next(_ids):016x}"
        assert (await adm.admit(k, rid, "chat", 300, team_id=team)).admitted
        await adm.settle(k, rid, "completed", prompt, 2, "r1", "chat", Cost(input_nanos=prompt * 100))
    # As a counter of a request admitted without Redis (no record, so no team) reads.
    await redis.hincrby(
        redis_names.usage(in_y.id), time.strftime("d:%Y%m%d", time.gmtime()) + ":model:chat:requests", 1
    )
    page = await completions_usage(redis, [in_y], parse_query(query(start_time=today(), group_by="project_id")))
    got = {r["project_id"]: (r["num_model_requests"], r["input_tokens"]) for r in page["data"][0]["results"]}
    assert got == {"tmoverx": (1, 198), "tmovery": (2, 7)}
    x_only = await costs(redis, [in_y], parse_query(query(start_time=today(), project_ids="tmoverx"), COST_GROUPS))
    assert [r["amount"]["value"] for r in x_only["data"][0]["results"]] == [198 * 100 / 1e9]


async def test_days_are_buckets_paged_by_limit_and_an_empty_day_is_an_empty_bucket(redis):
    adm = AdmissionScripts(redis, lease_s=60, retention_s=3600)
    k = key("kusagepage")
    await run(adm, k, "chat", 10, "completed", 1, 1)
    start = today() - 9 * 86400
    first = await completions_usage(redis, [k], parse_query(query(start_time=start + 3600, limit=4)))
    openai_spec.validate(first, "UsageResponse")
    assert [b["start_time"] for b in first["data"]] == [start + n * 86400 for n in range(4)]
    assert all(b["results"] == [] for b in first["data"]) and first["has_more"]
    pages, cursor = [first], first["next_page"]
    while cursor:
        page = await completions_usage(redis, [k], parse_query(query(start_time=start, limit=4, page=cursor)))
        pages.append(page)
        cursor = page["next_page"]
    days = [b for page in pages for b in page["data"]]
    assert len(days) == 10 and days[-1]["start_time"] == today() and days[-1]["results"][0]["num_model_requests"] == 1
    # A page is its own days only, however far back the range starts (no list of every day).
    far = await completions_usage(redis, [k], parse_query(query(start_time=0, limit=2)))
    assert [b["start_time"] for b in far["data"]] == [0, 86400] and far["next_page"] == str(2 * 86400)


@pytest.mark.parametrize(
    "params, param",
    [
        ({}, "start_time"),
        ({"start_time": "yesterday"}, "start_time"),
        ({"start_time": "-5"}, "start_time"),
        ({"start_time": "1" * 30}, "start_time"),
        ({"start_time": ["1", "2"]}, "start_time"),
        ({"start_time": "100", "end_time": "50"}, "end_time"),
        ({"start_time": "100", "bucket_width": "1h"}, "bucket_width"),
        ({"start_time": "100", "group_by": "user_id"}, "group_by"),
        ({"start_time": "100", "group_by": "x'); DROP"}, "group_by"),
        ({"start_time": "100", "limit": "0"}, "limit"),
        ({"start_time": "100", "limit": "32"}, "limit"),
        ({"start_time": "100", "limit": "1e3"}, "limit"),
        ({"start_time": "100", "page": "next"}, "page"),
        ({"start_time": "0", "end_time": str(2**40)}, "end_time"),  # 12.7 million days
        ({"start_time": "0", "end_time": str(401 * 86400)}, "end_time"),
        ({"start_time": "1099511000000", "end_time": "1099511600000"}, "start_time"),  # past the year 9999: was a 500
        ({"start_time": str(LAST_TIME + 1)}, "start_time"),
        ({"start_time": "100", "page": str(LAST_TIME + 1)}, "page"),
        ({"start_time": "²"}, "start_time"),  # a digit to str.isdigit, not to int()
        ({"start_time": "１００"}, "start_time"),  # full-width digits
    ],
)
def test_a_query_it_cannot_serve_is_a_400_naming_the_parameter(params, param):
    with pytest.raises(OpenAIError) as caught:
        parse_query(query(**params))
    assert caught.value.status == 400 and caught.value.param == param


def test_group_by_in_either_list_form_and_comma_separated():
    assert parse_query(query(start_time=0, **{"group_by[]": ["model", "api_key_id"]})).group_by == (
        "model",
        "api_key_id",
    )
    assert parse_query(query(start_time=0, group_by="model,api_key_id,model")).group_by == ("model", "api_key_id")


# -- costs ------------------------------------------------------------------------


def test_a_cost_is_its_tokens_priced_and_a_batch_pays_the_discounted_price():
    pricing = Pricing(prompt_per_million=0.15, completion_per_million=0.6, batch_discount=0.5)
    assert Cost.of(Rates.of(pricing), 1000, 500, 10, 10) == Cost(input_nanos=150_000, output_nanos=300_000)
    assert Cost.of(Rates.of(pricing, batch=True), 1000, 500, 10, 10) == Cost(75_000, 150_000)
    # Usage never reported: the reservation (prompt estimate, max completion) is priced.
    assert Cost.of(Rates.of(pricing), -1, -1, 100, 1000) == Cost(reserved_nanos=15_000 + 600_000)
    assert Cost.of(None, 1000, 500, 0, 0) == Cost()  # not priced
    assert Cost.of(Rates.of(Pricing(prompt_per_million=0.0375)), 3, 0, 0, 0) == Cost(input_nanos=112)  # rounded


def test_cached_prompt_tokens_pay_the_cached_price_and_never_more_than_the_prompt():
    pricing = Pricing(
        prompt_per_million=1.0, completion_per_million=4.0, cached_prompt_per_million=0.25, batch_discount=0.5
    )
    assert Cost.of(Rates.of(pricing), 1000, 10, 0, 0, cached_prompt=800) == Cost(
        input_nanos=200 * 1000 + 800 * 250, output_nanos=40_000, cached_prompt_tokens=800
    )
    assert Cost.of(Rates.of(pricing, batch=True), 1000, 0, 0, 0, cached_prompt=800) == Cost(
        input_nanos=(200_000 + 200_000) // 2, cached_prompt_tokens=800
    )
    # A count past the prompt (or below zero) is clamped: no negative cost, no discount beyond the prompt.
    assert Cost.of(Rates.of(pricing), 100, 0, 0, 0, cached_prompt=10**9) == Cost(
        input_nanos=25_000, cached_prompt_tokens=100
    )
    assert Cost.of(Rates.of(pricing), 100, 0, 0, 0, cached_prompt=-5) == Cost(input_nanos=100_000)
    # No cached price: cached tokens cost what any prompt token does (and are still counted).
    plain = Rates.of(Pricing(prompt_per_million=1.0))
    assert Cost.of(plain, 1000, 0, 0, 0, cached_prompt=800) == Cost(input_nanos=1_000_000, cached_prompt_tokens=800)
    # Usage never reported: the reservation at the full prompt price (what admission held).
    assert Cost.of(Rates.of(pricing), -1, -1, 100, 10, cached_prompt=50) == Cost(reserved_nanos=100_000 + 40_000)


@pytest.mark.parametrize(
    "usage, expected",
    [
        (
            {"prompt_tokens": 300, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 256}},
            (300, 2, 256),
        ),
        ({"prompt_tokens": 300, "completion_tokens": 2, "prompt_tokens_details": None}, (300, 2, 0)),
        ({"prompt_tokens": 300, "completion_tokens": 2}, (300, 2, 0)),
    ],
)
def test_the_cached_count_is_read_from_openais_usage(usage, expected):
    got = Usage.from_openai(usage)
    assert (got.prompt_tokens, got.completion_tokens, got.cached_prompt_tokens) == expected


def test_the_cached_count_is_read_from_responses_and_anthropic_usage():
    responses = Usage.from_input_output(
        {"input_tokens": 300, "output_tokens": 4, "input_tokens_details": {"cached_tokens": 256}}
    )
    assert (responses.prompt_tokens, responses.cached_prompt_tokens) == (300, 256)
    # Anthropic counts cache reads apart from input_tokens.
    anthropic = Usage.from_input_output({"input_tokens": 44, "cache_read_input_tokens": 256, "output_tokens": 4})
    assert (anthropic.prompt_tokens, anthropic.cached_prompt_tokens) == (300, 256)


async def test_cached_tokens_are_counted_apart_and_priced_at_settlement(redis_url, redis):
    access = build_quota_services(AppSettings(redis_url=redis_url), Telemetry(False, False))
    try:
        k = key("kcached")
        for cached in (256, 0):
            ticket = await access.gate.admit(k, "chat", 400)
            ticket.rates = Rates.of(
                Pricing(prompt_per_million=1.0, completion_per_million=4.0, cached_prompt_per_million=0.25)
            )
            ticket.reserved = (300, 100)
            access.gate.settle(
                ticket, "completed", Usage(prompt_tokens=300, completion_tokens=10, cached_prompt_tokens=cached)
            )
        while access.gate._background:
            await asyncio.sleep(0.01)
        [row] = (await completions_usage(redis, [k], parse_query(query(start_time=today()))))["data"][0]["results"]
        assert (row["input_tokens"], row["input_cached_tokens"], row["output_tokens"]) == (600, 256, 20)
        costs_page = await costs(redis, [k], parse_query(query(start_time=today(), group_by="line_item"), COST_GROUPS))
        got = {r["line_item"]: r["amount"]["value"] for r in costs_page["data"][0]["results"]}
        assert got == {"chat, input": (44 * 1000 + 256 * 250 + 300 * 1000) / 1e9, "chat, output": 80_000 / 1e9}
        names = [name async for name in redis.scan_iter(match=redis_names.request_record_prefix(k.id) + "*")]
        records = [{as_text(f): as_text(v) for f, v in (await redis.hgetall(name)).items()} for name in names]
        assert sorted(int(r["cached_tokens"]) for r in records) == [0, 256]
    finally:
        await access.redis.aclose()


async def test_costs_are_recorded_at_settlement_and_served_in_openais_shape(redis_url, redis):
    access = build_quota_services(AppSettings(redis_url=redis_url), Telemetry(False, False))
    try:
        k = key("kcosts")
        rates = Rates.of(Pricing(prompt_per_million=2.0, completion_per_million=8.0, batch_discount=0.5))
        for usage, batch in (
            (Usage(prompt_tokens=1000, completion_tokens=500), False),
            (Usage(prompt_tokens=1000, completion_tokens=500), True),
            (None, False),
        ):  # a stream its client hung up on
            ticket = await access.gate.admit(k, "chat", 1200)
            ticket.rates = Rates.of(
                Pricing(prompt_per_million=2.0, completion_per_million=8.0, batch_discount=0.5), batch=batch
            )
            ticket.reserved = (200, 1000)
            access.gate.settle(ticket, "completed" if usage else "cancelled", usage)
        while access.gate._background:
            await asyncio.sleep(0.01)
        assert rates.prompt == 2000
        page = await completions_usage(redis, [k], parse_query(query(start_time=today())))
        assert page["data"][0]["results"][0]["num_model_requests"] == 3
        costs_page = await costs(
            redis, [k], parse_query(query(start_time=today(), group_by=["line_item", "api_key_id"]), COST_GROUPS)
        )
        openai_spec.validate(costs_page, "UsageResponse")
        got = {r["line_item"]: r["amount"] for r in costs_page["data"][0]["results"]}
        assert got == {
            "chat, input": {"value": 0.002 + 0.001, "currency": "usd"},
            "chat, output": {"value": 0.004 + 0.002, "currency": "usd"},
            "chat, reserved": {"value": 0.0004 + 0.008, "currency": "usd"},
        }
        day, month = time.strftime("d:%Y%m%d", time.gmtime()), time.strftime("m:%Y%m", time.gmtime())
        totals = [int(await redis.hget(redis_names.usage(k.id), f"{period}:cost_nanos")) for period in (day, month)]
        assert totals == [3_000_000 + 6_000_000 + 8_400_000] * 2
        with pytest.raises(OpenAIError) as caught:
            parse_query(query(start_time=0, group_by="model"), COST_GROUPS)
        assert caught.value.param == "group_by"
    finally:
        await access.redis.aclose()
