"""The admission scripts against a real Redis (its TIME, its atomicity)."""

import asyncio
import datetime

from redis.asyncio.cluster import RedisCluster
from redis_server import every_node

from serve_app.accounting.costs import Cost
from serve_app.accounting.usage import edge_request_tag
from serve_app.admission.scripts import AdmissionScripts
from serve_app.identity.keys import KeyRecord
from serve_app.redis_store import redis_names

_ids = iter(range(10**9))


def key(**limits) -> KeyRecord:
    return KeyRecord(id="ktest", name="test", created_at=0, **limits)


def admission(redis, lease_s=600):
    return AdmissionScripts(redis, lease_s=lease_s, retention_s=3600)


async def admit(adm, k, tokens=1, model="m"):
    rid = f"req-{next(_ids)}"
    return rid, await adm.admit(k, rid, model, tokens)


async def test_requests_per_minute_allows_a_burst_then_refuses_with_exact_retry(redis):
    adm, k = admission(redis), key(requests_per_minute=5)
    decisions = [(await admit(adm, k))[1] for _ in range(6)]
    assert [d.admitted for d in decisions] == [True] * 5 + [False]
    assert [d.requests_remaining for d in decisions[:5]] == [4, 3, 2, 1, 0]
    refused = decisions[-1]
    assert refused.kind == "requests"
    assert 11_000 < refused.retry_ms <= 12_000  # one request every 12 s after the burst
    headers = refused.headers(k)
    assert headers["x-ratelimit-limit-requests"] == "5"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["retry-after"] == "12"
    assert int(headers["retry-after-ms"]) == refused.retry_ms


async def test_waiting_retry_after_is_enough(redis):
    adm, k = admission(redis), key(requests_per_minute=120)  # one every 0.5 s
    while (await admit(adm, k))[1].admitted:
        pass
    _, refused = await admit(adm, k)
    assert 0 < refused.retry_ms <= 500
    await asyncio.sleep(refused.retry_ms / 1000)
    assert (await admit(adm, k))[1].admitted


async def test_concurrent_reservations_never_overshoot_tokens_per_minute(redis):
    adm, k = admission(redis), key(tokens_per_minute=1000)
    results = await asyncio.gather(*(admit(adm, k, tokens=100) for _ in range(25)))
    assert sum(d.admitted for _, d in results) == 10
    assert {d.kind for _, d in results if not d.admitted} == {"tokens"}


async def test_settle_refunds_unused_reservation(redis):
    adm, k = admission(redis), key(tokens_per_minute=1000)
    first, d1 = await admit(adm, k, tokens=400)
    _, d2 = await admit(adm, k, tokens=400)
    _, d3 = await admit(adm, k, tokens=400)
    assert d1.admitted and d2.admitted and not d3.admitted
    assert (await adm.settle(k, first, "completed", prompt_tokens=60, completion_tokens=40)).delta == -300
    assert (await admit(adm, k, tokens=400))[1].admitted


async def test_request_larger_than_the_limit_is_refused_without_retry(redis):
    adm, k = admission(redis), key(tokens_per_minute=1000)
    _, d = await admit(adm, k, tokens=1001)
    assert not d.admitted and d.kind == "tokens_too_large" and d.retry_ms == -1
    assert "retry-after" not in d.headers(k)


async def test_concurrency_slots_are_released_by_settle_and_by_lease_expiry(redis):
    adm, k = admission(redis, lease_s=0.3), key(max_concurrent=2)
    a, _ = await admit(adm, k)
    await admit(adm, k)
    _, refused = await admit(adm, k)
    assert refused.kind == "concurrency"
    await adm.settle(k, a, "cancelled")
    assert (await admit(adm, k))[1].admitted
    assert not (await admit(adm, k))[1].admitted
    await asyncio.sleep(0.35)  # leases of an ingress that died expire
    assert (await admit(adm, k))[1].admitted


async def test_daily_budget_counts_reservations_and_refunds(redis):
    adm, k = admission(redis), key(daily_token_budget=500)
    first, d1 = await admit(adm, k, tokens=300)
    _, d2 = await admit(adm, k, tokens=300)
    assert d1.admitted and not d2.admitted
    assert d2.kind == "daily_budget"
    now = datetime.datetime.now(datetime.UTC)
    midnight = (now + datetime.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    assert abs(d2.retry_ms / 1000 - (midnight - now).total_seconds()) < 5
    await adm.settle(k, first, "completed", prompt_tokens=30, completion_tokens=20)
    _, d3 = await admit(adm, k, tokens=300)
    assert d3.admitted
    assert d1.budget_used() == {"daily": 300, "monthly": 300}  # the budget-use metric's input
    assert d3.budget_used() == {"daily": 350, "monthly": 350}  # 50 settled + 300 reserved
    assert d2.budget_used() == {} and d2.detail == "300"  # a refusal names that period's use
    assert (await admit(adm, key(), tokens=5))[1].budget_used() == {}  # no budget, nothing to report


async def test_work_that_reserves_nothing_is_never_refused_by_a_budget_it_is_over(redis):
    """A tenant over its budgets (its limits lowered below what it used) may still list,
    read, delete and cancel: requests of no tokens and no cost. Anything that spends is refused."""
    adm = admission(redis)
    spender = key(
        daily_token_budget=1000, monthly_token_budget=1000, daily_cost_budget_usd=1.0, monthly_cost_budget_usd=1.0
    )
    rid, spent = await admit(adm, spender, tokens=600)
    assert spent.admitted
    await adm.settle(
        spender,
        rid,
        "completed",
        prompt_tokens=500,
        completion_tokens=100,
        cost=Cost(input_nanos=500_000, output_nanos=100_000),
    )
    lowered = spender.model_copy(
        update={
            "daily_token_budget": 100,
            "monthly_token_budget": 100,
            "daily_cost_budget_usd": 1e-4,
            "monthly_cost_budget_usd": 1e-4,
        }
    )
    for _ in range(2):  # twice: an admission of nothing changes nothing
        rid = f"req-{next(_ids)}"
        decision = await adm.admit(lowered, rid, "", 0, reserve_nanos=0)
        assert decision.admitted, decision
        await adm.settle(lowered, rid, "completed")
    rid = f"req-{next(_ids)}"
    refused = await adm.admit(lowered, rid, "m", 1, reserve_nanos=0)
    assert not refused.admitted and refused.kind in ("daily_budget", "monthly_budget")
    money_only = lowered.model_copy(update={"daily_token_budget": 0, "monthly_token_budget": 0})
    refused = await adm.admit(money_only, f"req-{next(_ids)}", "m", 0, reserve_nanos=1)
    assert not refused.admitted and refused.kind in ("daily_cost_budget", "monthly_cost_budget")


async def test_a_stored_accounts_limits_are_read_in_the_script_not_taken_from_the_caller(redis):
    """A replica's cached record may predate a change: a limit lowered in Redis applies to
    its next admission there, the refusal and headers name the limit applied, and a
    record disabled since is refused outright. A team's record the same."""
    adm = admission(redis)
    for account_id, record_name in (
        ("kstored", redis_names.key_record("kstored")),
        ("tstored", redis_names.team_record("tstored")),
    ):
        cached = KeyRecord(
            id=account_id, name=account_id, created_at=0, daily_token_budget=1000, requests_per_minute=100
        )
        await redis.set(record_name, cached.model_dump_json())
        rid, first = await admit(adm, cached, tokens=300)
        assert first.admitted and first.headers(cached)["x-ratelimit-limit-requests"] == "100"
        await adm.settle(cached, rid, "completed", prompt_tokens=200, completion_tokens=100)
        lowered = cached.model_copy(update={"daily_token_budget": 400, "requests_per_minute": 50})
        await redis.set(record_name, lowered.model_dump_json())
        _, refused = await admit(adm, cached, tokens=300)  # the caller still holds the old record
        assert not refused.admitted and refused.kind == "daily_budget"
        assert refused.as_applied(cached).daily_token_budget == 400
        assert refused.headers(cached)["x-ratelimit-limit-requests"] == "50"
        _, fits = await admit(adm, cached, tokens=100)
        assert fits.admitted
        await redis.set(record_name, lowered.model_copy(update={"enabled": False}).model_dump_json())
        _, revoked = await admit(adm, cached, tokens=1)
        assert not revoked.admitted and revoked.kind == "revoked" and revoked.retry_ms == -1


async def test_a_refund_uses_the_tokens_per_minute_its_request_was_admitted_under(redis):
    adm = admission(redis)
    cached = KeyRecord(id="kstored-tpm", name="tpm", created_at=0, tokens_per_minute=600)
    await redis.set(redis_names.key_record(cached.id), cached.model_dump_json())
    rid, first = await admit(adm, cached, tokens=600)
    assert first.admitted
    # The limit is raised meanwhile; the refund of 500 unused tokens is at the old rate.
    raised = cached.model_copy(update={"tokens_per_minute": 6000})
    await redis.set(redis_names.key_record(cached.id), raised.model_dump_json())
    await adm.settle(raised, rid, "completed", prompt_tokens=50, completion_tokens=50)
    _, second = await admit(adm, cached, tokens=1)
    # 100 of 600 used: at 6,000/min that is 1 s of the window, and 4,999 remain after this
    # one (and one more per 10 ms since the first admission: a loaded box takes some).
    assert second.admitted and 6000 - 100 * 10 - 1 <= second.tokens_remaining <= 6000 - 100 * 10 + 10, second


def day_usage(usage: dict[str, int], field: str) -> int:
    return next((value for name, value in usage.items() if name.endswith(f":{field}") and name.count(":") == 2), 0)


async def test_an_admission_withdrawn_to_be_made_again_counts_its_request_once(redis):
    """A request whose prompt the replica counted larger than reserved is admitted again:
    its first admission's reservation is taken back, and not counted as a refusal
    either; its request of requests/min stays (the replica rendered it) and is not
    charged again, so a key with one request a minute can still send it."""
    adm = admission(redis)
    k = key(requests_per_minute=1, tokens_per_minute=1000, daily_token_budget=1000)
    rid, first = await admit(adm, k, tokens=300)
    assert first.admitted
    assert await adm.release(k, rid, "", keep_request=True)
    rid = f"req-{next(_ids)}"
    again = await adm.admit(k, rid, "m", 900, request_paid=True)
    assert again.admitted, again
    usage = {name.decode(): int(value) for name, value in (await redis.hgetall(redis_names.usage(k.id))).items()}
    assert day_usage(usage, "requests") == 1 and day_usage(usage, "tokens") == 900
    assert not any(name.endswith(":refused") for name in usage) and not await redis.hgetall(redis_names.refusals(k.id))
    await adm.settle(k, rid, "completed", prompt_tokens=850, completion_tokens=10)
    assert (await admit(adm, k))[1].kind == "requests"  # the minute's one request was the rendered one


async def test_a_render_is_a_request_even_when_its_second_admission_is_refused(redis):
    """Admitted at its estimate, rendered by the replica, then refused at its real size
    (here: past the day's budget): its request of requests/min stays charged and it
    counts as a refusal, not a request. So a key of 3 requests/min makes the replica
    render at most 3 prompts a minute, however its second admissions end."""
    adm = admission(redis)
    k = key(requests_per_minute=3, daily_token_budget=500)
    renders = 0
    for _ in range(10):
        rid, first = await admit(adm, k, tokens=100)
        if not first.admitted:
            assert first.kind == "requests"
            continue
        renders += 1  # the replica renders it: 900 tokens
        assert await adm.release(k, rid, "", keep_request=True)
        again = await adm.admit(k, f"req-{next(_ids)}", "m", 900, request_paid=True)
        assert not again.admitted and again.kind == "daily_budget" and again.retry_ms == -1
    assert renders == 3
    usage = {name.decode(): int(value) for name, value in (await redis.hgetall(redis_names.usage(k.id))).items()}
    assert day_usage(usage, "requests") == 0 and day_usage(usage, "tokens") == 0
    assert day_usage(usage, "refused") == 3 + 7  # three at their real size, seven by requests/min


async def test_a_withdrawal_that_keeps_no_request_gives_requests_per_minute_back(redis):
    adm, k = admission(redis), key(requests_per_minute=1)
    rid, first = await admit(adm, k)
    assert first.admitted and await adm.release(k, rid, "")
    assert (await admit(adm, k))[1].admitted


async def test_monthly_budget(redis):
    adm, k = admission(redis), key(monthly_token_budget=100)
    assert (await admit(adm, k, tokens=100))[1].admitted
    _, d = await admit(adm, k, tokens=1)
    assert not d.admitted and d.kind == "monthly_budget"
    now = datetime.datetime.now(datetime.UTC)
    first_next = (now.replace(day=1) + datetime.timedelta(days=32)).replace(
        day=1, hour=0, minute=0, second=0, microsecond=0
    )
    assert abs(d.retry_ms / 1000 - (first_next - now).total_seconds()) < 5


async def test_request_record_lifecycle_and_usage_counters(redis):
    adm, k = admission(redis), key(tokens_per_minute=10_000)
    rid, d = await admit(adm, k, tokens=500, model="tiny-llama")
    record = redis_names.request_record(k.id, rid)
    assert (await redis.hget(record, "status")) == b"admitted"
    await adm.running(k.id, rid, "replica-1")
    assert (await redis.hget(record, "status")) == b"running"
    assert (
        await adm.settle(k, rid, "completed", prompt_tokens=20, completion_tokens=30, replica="replica-1")
    ).delta == -450
    assert await adm.settle(k, rid, "completed", prompt_tokens=20, completion_tokens=30) is None  # idempotent
    await adm.running(k.id, rid)  # never moves a settled request back
    fields = {key.decode(): value.decode() for key, value in (await redis.hgetall(record)).items()}
    assert fields["status"] == "completed" and fields["model"] == "tiny-llama"
    assert fields["total_tokens"] == "50" and fields["replica"] == "replica-1"
    assert int(fields["received_ms"]) <= int(fields["first_token_ms"]) <= int(fields["finished_ms"])
    assert 0 < await redis.ttl(record) <= 3600
    today = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    usage = await redis.hgetall(redis_names.usage(k.id))
    assert usage[f"d:{today}:tokens".encode()] == b"50"
    assert usage[f"d:{today}:requests".encode()] == b"1"
    assert usage[f"m:{today[:6]}:completion_tokens".encode()] == b"30"


async def test_a_failed_over_request_has_one_record_that_says_where_it_went(redis):
    """A request retried on another replica is settled once, its record naming what
    failed on its way (Gatekeeper.settle joins Ticket.failover); a retried settle
    changes nothing."""
    adm, k = admission(redis), key(tokens_per_minute=10_000)
    rid, _ = await admit(adm, k, tokens=500, model="tiny-llama")
    failover = "replica-1:died,replica-2:stalled"
    assert (await adm.settle(k, rid, "completed", 20, 30, "replica-3", "tiny-llama", failover=failover)).delta == -450
    assert await adm.settle(k, rid, "completed", 20, 30, "replica-3", "tiny-llama", failover=failover) is None
    fields = await redis.hgetall(redis_names.request_record(k.id, rid))
    assert fields[b"failover"] == failover.encode() and fields[b"replica"] == b"replica-3"
    today = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    assert await redis.hget(redis_names.usage(k.id), f"d:{today}:requests") == b"1"
    plain, _ = await admit(adm, k, tokens=10, model="tiny-llama")
    await adm.settle(k, plain, "completed", 1, 1, "replica-3", "tiny-llama")
    assert not await redis.hexists(redis_names.request_record(k.id, plain), "failover")


async def test_a_try_the_edge_sent_again_takes_over_its_first_admission_and_is_charged_once(redis):
    """HAProxy sends a one-hop request again when its replica died before answering
    (cluster/haproxy_edge.py), with the id it gave it: the second try is admitted under
    the first's admission ('again': no second lease, reservation or request charged), is
    settled once, and a try after that is refused as a duplicate, never run free."""
    adm, k = admission(redis), key(tokens_per_minute=1000, requests_per_minute=10, max_concurrent=1)
    rid = "ktest-" + edge_request_tag("0b9f4a52-5c1e-4f7e-9d6a-2f0e3c4b5a69", "1764000000000000")
    first = await adm.admit(k, rid, "tiny-llama", 400)
    again = await adm.admit(k, rid, "tiny-llama", 400)
    assert (first.admitted, first.kind) == (True, "") and (again.admitted, again.kind) == (True, "again")
    assert (again.requests_remaining, again.tokens_remaining) == (first.requests_remaining, first.tokens_remaining)
    assert not (await admit(adm, k))[1].admitted  # its one concurrent place is the first's, held once
    assert (await adm.settle(k, rid, "completed", 20, 30, "replica-2", "tiny-llama", failover="edge:retried")).delta
    today = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    assert await redis.hget(redis_names.usage(k.id), f"d:{today}:requests") == b"1"
    assert await redis.hget(redis_names.usage(k.id), f"d:{today}:tokens") == b"50"
    assert (await adm.admit(k, rid, "tiny-llama", 400)).kind == "duplicate"
    assert (await admit(adm, k))[1].admitted  # the place is free again


async def test_refusals_are_counted_per_minute_not_stored(redis):
    adm, k = admission(redis), key(requests_per_minute=1)
    await admit(adm, k)
    refused = [await admit(adm, k) for _ in range(5)]
    assert not any(d.admitted for _, d in refused)
    assert not await redis.exists(*(redis_names.request_record(k.id, rid) for rid, _ in refused))
    counts = await redis.hgetall(redis_names.refusals(k.id))
    assert list(counts.values()) == [b"5"] and list(counts)[0].endswith(b":requests")
    assert 3600 < await redis.ttl(redis_names.refusals(k.id)) <= 3660
    today = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    assert await redis.hget(redis_names.usage(k.id), f"d:{today}:refused") == b"5"
    from serve_app.accounting.usage import key_usage

    usage = await key_usage(redis, k.id)
    assert usage["today"]["refused"] == 5 and usage["refused_last_hour"] == {"requests": 5}


async def test_unlimited_key_gets_no_rate_headers(redis):
    adm, k = admission(redis), key()
    _, d = await admit(adm, k, tokens=10**6)
    assert d.admitted and d.headers(k) == {}


async def commandstats(redis) -> dict[str, int]:
    """Calls per command, summed over every node (a cluster's are per primary)."""
    if isinstance(redis, RedisCluster):
        per_node = list((await redis.info("commandstats", target_nodes=RedisCluster.PRIMARIES)).values())
    else:
        per_node = [await redis.info("commandstats")]
    calls: dict[str, int] = {}
    for stats in per_node:
        for name, value in stats.items():
            if name.startswith("cmdstat_"):
                calls[name] = calls.get(name, 0) + value["calls"]
    return calls


async def test_scripts_are_called_by_sha(redis):
    adm, k = admission(redis), key(requests_per_minute=10)
    await admit(adm, k)  # a cluster client loads the script on NOSCRIPT; counted from here
    await redis.config_resetstat(**every_node(redis))
    await admit(adm, k)
    await admit(adm, k)
    calls = await commandstats(redis)
    assert calls["cmdstat_evalsha"] == 2
    assert "cmdstat_eval" not in calls
    assert "cmdstat_script|exists" not in calls  # one round trip: no SCRIPT EXISTS first


async def test_unknown_usage_keeps_the_reservation_charged(redis):
    adm, k = admission(redis), key(tokens_per_minute=1000, max_concurrent=1)
    rid, _ = await admit(adm, k, tokens=600)
    assert (await adm.settle(k, rid, "cancelled", -1, -1)).delta == 0
    fields = await redis.hgetall(redis_names.request_record(k.id, rid))
    assert fields[b"status"] == b"cancelled" and fields[b"total_tokens"] == b"600"
    assert (await admit(adm, k, tokens=600))[1].kind == "tokens"  # slot free, tokens still spent


async def test_http_request_id_finds_the_record(redis):
    from serve_app.accounting.usage import request_state

    adm, k = admission(redis), key()
    rid = "ktest-0123456789abcdef"
    await adm.admit(k, rid, "m", 10, http_request_id="3f1c-serve-id")
    await adm.index_http_id("3f1c-serve-id", rid)
    assert (await request_state(redis, "3f1c-serve-id"))["id"] == rid
    assert (await request_state(redis, "chatcmpl-" + rid))["status"] == "admitted"
    assert await request_state(redis, "unknown-id") is None


async def test_an_x_request_id_reused_by_another_key_never_takes_over_the_first_keys_lookup(redis):
    from serve_app.accounting.usage import request_state

    adm = admission(redis)
    first, other = "kfirst-0123456789abcdef", "kother-0123456789abcdef"
    for rid, key_id in ((first, "kfirst"), (other, "kother")):
        await adm.admit(KeyRecord(id=key_id, name=key_id, created_at=0), rid, "m", 10, http_request_id="shared-id")
        await adm.index_http_id("shared-id", rid)
    assert (await request_state(redis, "shared-id"))["id"] == first  # the first to use it keeps it
    assert (await request_state(redis, "shared-id", "kother"))["id"] == other  # each key finds its own
    assert (await request_state(redis, "shared-id", "kfirst"))["id"] == first
    assert await request_state(redis, "shared-id", "knobody") is None
    assert await request_state(redis, first, "kother") is None  # another key's request id, named with a key


async def test_room_before_the_body_charges_nothing_and_refuses_as_admission_would(redis):
    """room.lua, asked before a large body is read: while the key has room it charges
    nothing (its two requests a minute are both still admitted); once at its
    requests/min it refuses with admission's own retry, counted as a refusal."""
    adm, k = admission(redis), key(requests_per_minute=2, tokens_per_minute=1000)
    for _ in range(3):
        assert (await adm.room(k)).admitted
    assert [(await admit(adm, k))[1].admitted for _ in range(2)] == [True, True]
    refused, by_admission = await adm.room(k), (await admit(adm, k))[1]
    assert not refused.admitted and refused.kind == by_admission.kind == "requests"
    assert abs(refused.retry_ms - by_admission.retry_ms) <= 5 and refused.retry_ms > 0
    headers, by_admission_headers = refused.headers(k), by_admission.headers(k)
    assert headers.keys() == by_admission_headers.keys()  # the same 429, its token limit's state included
    for name in ("retry-after", "x-ratelimit-remaining-requests", "x-ratelimit-limit-tokens"):
        assert headers[name] == by_admission_headers[name], name
    # Admission's state includes the refused request's own token (1): the room check's does not.
    assert int(headers["x-ratelimit-remaining-tokens"]) - int(by_admission_headers["x-ratelimit-remaining-tokens"]) in (
        0,
        1,
    )
    usage = {name.decode(): int(value) for name, value in (await redis.hgetall(redis_names.usage(k.id))).items()}
    assert day_usage(usage, "requests") == 2 and day_usage(usage, "refused") == 2


async def test_room_before_the_body_refuses_a_key_whose_concurrency_is_full(redis):
    adm, k = admission(redis), key(max_concurrent=1)
    rid, first = await admit(adm, k)
    assert first.admitted
    refused = await adm.room(k)
    assert not refused.admitted and refused.kind == "concurrency" and refused.retry_ms == 1000
    await adm.settle(k, rid, "completed", prompt_tokens=1, completion_tokens=1)
    assert (await adm.room(k)).admitted
