"""Quotas against hostile input and a misbehaving Redis, on a real redis-server:
honest retry-after for every mix of limits, refusals that store nothing,
leases renewed and reaped, late admits after a timeout, script errors and OOM
that refuse instead of failing open, and counters that stay bounded."""

import asyncio
import datetime
import os
import signal
import time

import pytest
import redis.asyncio as aioredis
from redis_server import every_node, running_redis

from contract.replica_wire import Usage
from serve_app.accounting.usage import edge_attempt_tag, edge_request_tag
from serve_app.admission.scripts import AdmissionScripts
from serve_app.admission.seam import EdgeAdmissionSettled, LocalOrigin, Refusal
from serve_app.errors import OpenAIError
from serve_app.http.services import QuotaServices, build_quota_services
from serve_app.identity.credential_guard import WINDOW_S
from serve_app.identity.keys import KeyRecord, KeyStore
from serve_app.identity.teams import TeamStore
from serve_app.redis_store import redis_names
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry

_ids = iter(range(10**9))


def key(id="khard", **limits) -> KeyRecord:
    return KeyRecord(id=id, name="hard", created_at=0, **limits)


def admission(redis, lease_s=600):
    return AdmissionScripts(redis, lease_s=lease_s, retention_s=3600)


async def admit(adm, k, tokens=1):
    rid = f"{k.id}-{next(_ids):016x}"
    return rid, await adm.admit(k, rid, "m", tokens)


async def exhaust(adm, k, tokens):
    """Admit requests of ``tokens`` until one is refused; return that refusal
    and the monotonic time just before it was asked for."""
    for _ in range(1000):
        asked = time.monotonic()
        _, decision = await admit(adm, k, tokens)
        if not decision.admitted:
            return decision, asked
    raise AssertionError("never refused")


# Mixes of limits (each window short enough to wait out) and the request cost
# that makes one or the other bind.
MIXES = {
    "requests only": (dict(requests_per_minute=120), 10),
    "tokens only": (dict(tokens_per_minute=12_000), 100),
    "requests bind before tokens": (dict(requests_per_minute=120, tokens_per_minute=100_000), 10),
    "tokens bind before requests": (dict(requests_per_minute=600, tokens_per_minute=12_000), 400),
    "both refuse, tokens wait longer": (dict(requests_per_minute=240, tokens_per_minute=6_000), 60),
    "requests and a budget far from full": (dict(requests_per_minute=120, daily_token_budget=10**9), 10),
}


@pytest.mark.parametrize("mix", sorted(MIXES))
async def test_waiting_exactly_retry_after_is_admitted_and_less_is_not(redis, mix):
    limits, tokens = MIXES[mix]
    adm = admission(redis)
    # Redis ran the refusal after `asked` and the early request before `answered`,
    # so their distance on its clock is at most `answered - asked`. A box that
    # stalls longer than the wait cannot show "too early", so that try proves
    # nothing and is made again on a fresh key (CI saw a 370 ms stall once).
    for attempt in range(5):
        k = key(id=f"khard{attempt}", **limits)
        refused, asked = await exhaust(adm, k, tokens)
        assert refused.retry_ms > 200, refused
        await asyncio.sleep(refused.retry_ms / 2000)  # half the wait: some limit still refuses
        _, early = await admit(adm, k, tokens)
        if (time.monotonic() - asked) * 1000 < refused.retry_ms:
            break
    else:
        pytest.fail("no try ran its early request within the wait")
    assert not early.admitted, (mix, refused, early)
    await asyncio.sleep(max(refused.retry_ms / 1000 - refused.retry_ms / 2000, 0) + 0.01)
    _, retried = await admit(adm, k, tokens)
    assert retried.admitted, (mix, refused, retried)


async def test_the_refusal_names_the_limit_with_the_longest_wait(redis):
    # 1 request/min and 1 concurrent request, one running: both refuse; the 1 s
    # concurrency hint would send the client into another 429.
    adm, k = admission(redis), key(requests_per_minute=1, max_concurrent=1)
    await admit(adm, k)
    _, refused = await admit(adm, k)
    assert refused.kind == "requests" and 59_000 < refused.retry_ms <= 60_000, refused
    assert refused.headers(k)["retry-after"] == "60"


@pytest.mark.parametrize(
    "limits, kind",
    [
        (dict(tokens_per_minute=100, requests_per_minute=1), "tokens_too_large"),
        (dict(daily_token_budget=150), "daily_budget"),
        (dict(monthly_token_budget=150, requests_per_minute=1), "monthly_budget"),
    ],
)
async def test_a_request_that_can_never_fit_gets_no_retry_after(redis, limits, kind):
    adm, k = admission(redis), key(**limits)
    await admit(adm, k, tokens=1)  # uses the one request/min where there is one
    _, refused = await admit(adm, k, tokens=200)
    assert not refused.admitted and refused.kind == kind and refused.retry_ms == -1, refused
    assert "retry-after" not in refused.headers(k)


async def test_a_late_admit_after_its_settlement_changes_nothing(redis):
    # The ingress timed out on admit, served the request on local limits and
    # settled it; the admit call then arrives. It must not take a slot or charge.
    adm, k = admission(redis), key(max_concurrent=1, daily_token_budget=1000)
    rid = "khard-00000000000000aa"
    origin = LocalOrigin("client-request-7", 1_795_000_000_123)
    assert (await adm.settle(k, rid, "completed", 7, 5, "", "m", origin=origin)).delta == 0
    late = await adm.admit(k, rid, "m", 500)
    assert not late.admitted and late.kind == "duplicate"
    assert await redis.zcard(redis_names.concurrency(k.id)) == 0
    record = {a.decode(): b.decode() for a, b in (await redis.hgetall(redis_names.request_record(k.id, rid))).items()}
    assert record["status"] == "completed" and record["admission"] == "local" and record["total_tokens"] == "12"
    # What Redis never saw of its admission: its client's x-request-id and when (soak/ledger.py matches on them).
    assert record["http_request_id"] == "client-request-7" and record["received_ms"] == "1795000000123"
    today = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    assert await redis.hget(redis_names.usage(k.id), f"d:{today}:tokens") == b"12"  # real usage, once
    assert (await admit(adm, k, tokens=500))[1].admitted  # the slot is free


async def test_an_admission_run_twice_stands_once(redis):
    """redis-py sends a script again when its reply was lost (a connection dropped in
    a failover or a slot move, after it ran): the second run answers the admission that
    stands and counts nothing twice (a CI run's failover answered it 503)."""
    adm, k = admission(redis), key(max_concurrent=1, requests_per_minute=5, daily_token_budget=1000)
    rid = "khard-00000000000000ab"
    first = await adm.admit(k, rid, "m", 100)
    again = await adm.admit(k, rid, "m", 100)
    assert first.admitted and again.admitted and again.kind == "again"  # admit.lua: the same admission, answered again
    assert again.headers(k)["x-ratelimit-remaining-requests"] == "4"  # the state now: it, once
    today = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    usage = await redis.hgetall(redis_names.usage(k.id))
    assert usage[f"d:{today}:requests".encode()] == b"1" and usage[f"d:{today}:tokens".encode()] == b"100"
    assert await redis.zcard(redis_names.concurrency(k.id)) == 1
    await adm.settle(k, rid, "completed", 7, 5, "", "m")
    assert (await adm.admit(k, rid, "m", 100)).kind == "duplicate"  # settled: changes nothing
    assert await redis.zcard(redis_names.concurrency(k.id)) == 0


async def test_renewal_keeps_running_leases_and_never_revives_settled_ones(redis):
    adm, k = admission(redis, lease_s=0.6), key(max_concurrent=2)
    a, _ = await admit(adm, k)
    b, _ = await admit(adm, k)
    for _ in range(8):  # 1.6 s: well past the lease, renewed every 0.2 s
        assert await adm.renew({k.id: [a, b]}) == 2
        await asyncio.sleep(0.2)
    assert (await admit(adm, k))[1].kind == "concurrency"
    await adm.settle(k, a, "completed", 1, 1)
    assert await adm.renew({k.id: [a, b]}) == 1
    assert await redis.zrange(redis_names.concurrency(k.id), 0, -1) == [b.encode()]


async def test_leases_that_expire_stop_counting_and_the_reaper_finalises_their_records(redis):
    # An ingress that died stops renewing: its requests' leases stop counting at once,
    # and the reaper (reap.lua, for the accounts the due index names) makes their
    # records final and takes the account off the index once no lease is left.
    adm, k = admission(redis, lease_s=0.2), key(max_concurrent=1)
    [registered] = adm.register_due([k.id], 0)  # due at once (the gatekeeper says when)
    dead, _ = await admit(adm, k, tokens=40)
    await registered
    await adm.running(k.id, dead)
    await asyncio.sleep(0.3)
    alive, decision = await admit(adm, k)
    assert decision.admitted  # the dead request's slot no longer counts
    assert await redis.hget(redis_names.request_record(k.id, dead), "status") == b"running"  # not final yet
    assert await adm.due_accounts() == [k.id]
    next_ms, records = await adm.reap(k.id)
    record = await redis.hgetall(redis_names.request_record(k.id, dead))
    assert record[b"status"] == b"abandoned" and record[b"total_tokens"] == b"40"
    assert records == []  # no sink: the record stays in Redis (its retention)
    assert next_ms > 0 and await adm.due_accounts() == []  # the live request's lease: due when it may expire
    assert await adm.settle(k, dead, "completed", 1, 1) is None  # final: a late settle changes nothing
    await adm.settle(k, alive, "completed", 1, 1)
    await asyncio.sleep(0.2)
    assert (await adm.reap(k.id))[0] == -1
    assert await redis.zcard(redis_names.LEASES_DUE) == 0  # nothing left: off the index


async def test_an_account_registered_within_a_lease_stays_due_though_it_had_no_lease(redis):
    # An ingress registers an account once per half lease and counts on that for the
    # leases it takes meanwhile: a reap that found none, just after such a registration,
    # must not take the account off the index (a lease taken next would never be
    # reaped); it is looked at again. A registration never puts a due time off.
    adm, k = admission(redis, lease_s=0.2), key(max_concurrent=1)
    await adm.register_due([k.id], 0)[0]
    assert await adm.due_accounts() == [k.id]
    assert (await adm.reap(k.id))[0] == -1  # no lease yet
    again = await redis.zscore(redis_names.LEASES_DUE, k.id)
    assert again is not None and await adm.due_accounts() == []  # looked at again, later
    await adm.register_due([k.id], int(again) + 60_000)[0]
    assert await redis.zscore(redis_names.LEASES_DUE, k.id) == again  # not put off
    dead, _ = await admit(adm, k)  # taken now, its ingress then dies
    await asyncio.sleep(0.35)  # the look again (a lease and a half), the lease expired
    assert await adm.due_accounts() == [k.id]
    await adm.reap(k.id)
    assert await redis.hget(redis_names.request_record(k.id, dead), "status") == b"abandoned"
    await asyncio.sleep(0.25)  # no registration within a lease: off the index at the next reap
    await redis.zadd(redis_names.LEASES_DUE, {k.id: 0})
    assert (await adm.reap(k.id))[0] == -1
    assert await redis.zcard(redis_names.LEASES_DUE) == 0 and await redis.zcard(redis_names.LEASES_SEEN) == 0


async def test_usage_counters_keep_35_days_and_13_months(redis):
    adm, k = admission(redis), key()
    now = datetime.datetime.now(datetime.UTC)
    old_day = (now - datetime.timedelta(days=40)).strftime("d:%Y%m%d")
    recent_day = (now - datetime.timedelta(days=3)).strftime("d:%Y%m%d")
    old_month = f"m:{now.year - 2}{now.month:02d}"
    usage = redis_names.usage(k.id)
    await redis.hset(usage, mapping={f"{old_day}:tokens": 5, f"{recent_day}:tokens": 6, f"{old_month}:tokens": 7})
    assert (await admit(adm, k))[1].admitted  # the key's first request today prunes
    fields = {f.decode() for f in await redis.hkeys(usage)}
    assert f"{recent_day}:tokens" in fields
    assert f"{old_day}:tokens" not in fields and f"{old_month}:tokens" not in fields
    assert 399 * 86400 < await redis.ttl(usage) <= 400 * 86400


# -- the ingress's quota services: which Redis errors fail open ---------------------------------


def ingress_access(url: str) -> QuotaServices:
    """What one ingress replica runs, with a short Redis timeout and lease."""
    return build_quota_services(
        AppSettings(redis_url=url, quota={"redis_timeout_s": 0.3, "concurrency_lease_s": 30}), Telemetry(False, False)
    )


@pytest.fixture
async def access(redis_url, redis):
    services = ingress_access(redis_url)
    yield services
    await services.redis.aclose()


@pytest.fixture
async def node_access(redis_server):
    """Quota services on the single node, for a test that stalls that one process."""
    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushdb()
    services = ingress_access(redis_server.url)
    yield services, client
    await services.redis.aclose()
    await client.aclose()


async def test_a_due_registration_redis_refused_is_made_again_at_the_next_tick(access, redis):
    # The due index is how a dead ingress' requests are found: an admission whose
    # registration failed must not wait for this ingress' next admission or renewal
    # (it may die first), but be registered at the next maintenance tick.
    k = key(max_concurrent=2)
    await redis.set(redis_names.LEASES_DUE, "not a sorted set")  # every ZADD to it fails
    ticket = await access.gate.admit(k, "m", 10)
    for _ in range(100):  # the registration went out in the admission's pipeline, and failed
        if k.id in access.gate._unregistered:
            break
        await asyncio.sleep(0.01)
    assert k.id in access.gate._unregistered
    await redis.delete(redis_names.LEASES_DUE)
    await access.gate.reap_abandoned()  # one tick
    for _ in range(100):
        if await redis.zscore(redis_names.LEASES_DUE, k.id) is not None:
            break
        await asyncio.sleep(0.01)
    assert await redis.zscore(redis_names.LEASES_DUE, k.id) is not None
    assert not access.gate._unregistered
    access.gate.settle(ticket, "completed", Usage(prompt_tokens=1, completion_tokens=1))


async def test_the_edges_try_takes_over_its_earlier_tries_admission_and_is_charged_once(access, redis):
    """The edge sent a request again (its replica died). Its first try had been admitted
    under the edge's first id, resized (that admission taken back, release.lua: its
    record gone) and admitted under the edge's next id, which is open. The try again does
    the same: its first id admitted and resized, and the next one taken over ('again'):
    one record, counted once, one place held, its lease running from then. Had that one
    been reaped (the dead replica's lease ran out first) its id is settled abandoned:
    EdgeAdmissionSettled, nothing admitted, and the gateway goes on to the edge's next id
    (a CI run answered the try a 503 'quota store error' after 42 s)."""
    k = key("kedge", max_concurrent=2, requests_per_minute=10)
    tag = edge_request_tag("0b9f4a52-5c1e-4f7e-9d6a-2f0e3c4b5a69", "1764000000000000")
    first, second, third = (f"{k.id}-{edge_attempt_tag(tag, n)}" for n in range(3))
    dead = admission(redis, lease_s=0.2)  # the dead replica's admissions of the first try
    assert (await dead.admit(k, first, "m", 40)).admitted
    await dead.release(k, first, "", keep_request=True)  # its prompt resized
    assert (await dead.admit(k, second, "m", 90, request_paid=True)).admitted
    today = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")

    estimated = await access.gate.admit(k, "m", 40, given_id=first)
    assert not isinstance(estimated, Refusal) and estimated.failover == []
    await access.gate.withdraw(estimated, keep_request=True)  # resized here too
    ticket = await access.gate.admit(k, "m", 90, request_paid=True, given_id=second)
    assert not isinstance(ticket, Refusal) and ticket.request_id == second and ticket.failover == ["edge:retried"]
    assert await redis.hget(redis_names.usage(k.id), f"d:{today}:requests") == b"1"
    assert await redis.zrange(redis_names.concurrency(k.id), 0, -1) == [second.encode()]
    access.gate.settle(ticket, "completed", Usage(prompt_tokens=70, completion_tokens=5))
    await access.gate.flush_unsettled()
    for _ in range(100):
        if await redis.hget(redis_names.request_record(k.id, second), "status") == b"completed":
            break
        await asyncio.sleep(0.01)
    assert await redis.hget(redis_names.usage(k.id), f"d:{today}:tokens") == b"75"  # what it used, once
    assert not await redis.exists(redis_names.request_record(k.id, first))

    # A completed one was answered (a unary answer settles before its bytes are
    # written): the edge's try of it is never run a second time.
    with pytest.raises(OpenAIError) as caught:
        await access.gate.admit(k, "m", 40, given_id=second)
    assert caught.value.code == "quota_backend_error"

    # Taken over, a lease runs from then: the dead holder's expiry does not reap it.
    assert (await dead.admit(k, third, "m", 90, request_paid=True)).admitted
    await asyncio.sleep(0.1)
    again = await access.gate.admit(k, "m", 90, request_paid=True, given_id=third)
    assert not isinstance(again, Refusal) and again.failover == ["edge:retried"]
    await asyncio.sleep(0.2)  # past the dead holder's 0.2 s lease
    await dead.reap(k.id)
    assert await redis.hget(redis_names.request_record(k.id, third), "status") == b"admitted"
    await access.gate.withdraw(again)  # (the test's own: reaped in the next case)

    assert (await dead.admit(k, third, "m", 90, request_paid=True)).admitted
    await asyncio.sleep(0.3)
    await dead.reap(k.id)
    assert await redis.hget(redis_names.request_record(k.id, third), "status") == b"abandoned"
    with pytest.raises(EdgeAdmissionSettled):
        await access.gate.admit(k, "m", 40, given_id=third)
    assert await redis.zcard(redis_names.concurrency(k.id)) == 0  # nothing taken by that call
    # Without the edge's id, a settled id stays what it was: a 503, never a second run.
    with pytest.raises(OpenAIError) as caught:
        await access.gate.admit(k, "m", 40, request_id=third)
    assert caught.value.code == "quota_backend_error"


async def test_a_script_error_is_a_503_and_leaks_no_slot(access, redis):
    # A reservation Redis cannot add (beyond 64-bit) makes the script fail
    # mid-way; the request must not be served on local limits.
    k = key(max_concurrent=1)
    with pytest.raises(OpenAIError) as caught:
        await access.gate.admit(k, "m", 10**30)
    assert caught.value.status == 503 and caught.value.code == "quota_backend_error"
    await access.gate.flush_unsettled()
    assert not access.gate._unsettled
    assert await redis.zcard(redis_names.concurrency(k.id)) == 0
    ticket = await access.gate.admit(k, "m", 10)
    assert not ticket.local


async def test_out_of_memory_is_a_503_not_a_local_admission(access, redis):
    k = key(requests_per_minute=100)
    await redis.config_set("maxmemory-policy", "noeviction", **every_node(redis))
    await redis.config_set("maxmemory", 1, **every_node(redis))
    try:
        with pytest.raises(OpenAIError) as caught:
            await access.gate.admit(k, "m", 10)
    finally:
        await redis.config_set("maxmemory", 0, **every_node(redis))
    assert caught.value.status == 503 and caught.value.code == "quota_backend_error"
    await access.gate.flush_unsettled()
    assert await redis.zcard(redis_names.concurrency(k.id)) == 0


async def test_a_stalled_redis_is_settled_once_it_answers(node_access, redis_server):
    # A stopped redis-server (SIGSTOP) stalls: the admit call times out but stays
    # in the server's socket and runs when it resumes; the request is served on
    # local limits, and its settlement is retried until Redis takes it.
    # Afterwards: no lease, one charge of the real usage, a final record.
    access, redis = node_access
    k = key(max_concurrent=1, daily_token_budget=10_000)
    await access.gate.admit(k, "m", 1)  # connections are open before the stall
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        ticket = await access.gate.admit(k, "m", 500, http_request_id="stalled-7")
        assert ticket.local
        access.gate.settle(ticket, "completed", Usage(prompt_tokens=9, completion_tokens=4))
        assert await access.gate.flush_unsettled() == 0  # still stalled
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    while access.gate._unsettled:
        await access.gate.flush_unsettled()
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # any admit call still in flight has run by now
    assert await redis.zcard(redis_names.concurrency(k.id)) == 1  # the first request's, unsettled
    record = await redis.hgetall(redis_names.request_record(k.id, ticket.request_id))
    assert record[b"status"] == b"completed" and record[b"total_tokens"] == b"13"
    # Found by its x-request-id, as an admission through Redis is (a dashboards run
    # looked up such a stream for 60 s in vain: no index was written without Redis).
    assert record[b"http_request_id"] == b"stalled-7"
    for index in (redis_names.http_request("stalled-7"), redis_names.http_request("stalled-7", k.id)):
        assert await redis.get(index) == ticket.request_id.encode()
    today = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    assert await redis.hget(redis_names.usage(k.id), f"d:{today}:tokens") == b"14"  # 1 reserved + 13 used
    await redis.delete(redis_names.concurrency(k.id))  # (the first request ends)
    assert not (await access.gate.admit(k, "m", 10)).local


async def test_a_timeout_while_the_ingress_runs_late_is_shed_not_admitted_locally(node_access, redis_server):
    # The same stall, twice: on a punctual loop the timeout is Redis' (fail_mode open
    # admits on local limits); after the loop itself stalled 0.2 s (its CPU spent, as an
    # overloaded ingress' is), a timeout says nothing about Redis: 503, no local admission.
    # (The watcher sees 0.1-0.2 s of lag: past a quarter of the 0.3 s timeout, not always
    # past half, where the soak found replicas admitting locally on a healthy Redis.)
    access, redis = node_access
    k = key(max_concurrent=5)
    await access.gate.admit(k, "m", 1)  # connections are open before the stall
    access.gate.loop_lag.start()
    await asyncio.sleep(0.3)  # the watcher has seen a punctual loop
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        punctual = await access.gate.admit(k, "m", 10)
        assert punctual.local
        time.sleep(0.2)  # the loop stalls
        with pytest.raises(OpenAIError) as caught:
            await access.gate.admit(k, "m", 10)
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert caught.value.status == 503 and caught.value.code == "gateway_overloaded"
    assert caught.value.headers["retry-after"] == "1"
    assert access.gate.local._keys[k.id].running == {punctual.request_id}  # the shed one holds no local slot
    access.gate.settle(punctual, "completed", Usage(prompt_tokens=3, completion_tokens=2))
    while access.gate._unsettled:
        await access.gate.flush_unsettled()
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # any admit call still in flight has run by now
    await access.gate.flush_unsettled()
    assert await redis.zcard(redis_names.concurrency(k.id)) == 1  # the first request's only


async def punctual_then_late(access, redis_server, lookup) -> tuple[OpenAIError, OpenAIError]:
    """What ``lookup(0)`` raises while Redis is stopped on a punctual loop, and what
    ``lookup(1)`` raises when the loop stalls while it is out."""
    access.gate.loop_lag.start()
    await asyncio.sleep(0.3)  # the watcher has seen a punctual loop
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(OpenAIError) as punctual:
            await lookup(0)
        pending = asyncio.ensure_future(lookup(1))
        await asyncio.sleep(0)  # the look-up is out
        time.sleep(0.2)  # the loop stalls
        with pytest.raises(OpenAIError) as late:
            await pending
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    return punctual.value, late.value


async def test_a_key_look_up_that_fails_while_the_ingress_runs_late_is_shed(node_access, redis_server):
    # The soak: a replica at cold start, its loop 0.7 s late, timed out looking its first
    # clients' keys up and told them the quota store was down (503
    # quota_backend_unavailable). On a punctual loop that is what a stopped Redis means;
    # after the loop itself stalled, it is the ingress' overload: shed, retry-after.
    access, redis = node_access
    secrets = [(await KeyStore(redis).create(f"cold-{n}"))[1] for n in (1, 2)]
    punctual, late = await punctual_then_late(
        access, redis_server, lambda n: access.authenticator.authenticate({"authorization": f"Bearer {secrets[n]}"})
    )
    assert (punctual.status, punctual.code) == (503, "quota_backend_unavailable")
    assert (late.status, late.code) == (503, "gateway_overloaded")
    assert late.headers["retry-after"] == "1"


async def test_a_team_look_up_that_fails_while_the_ingress_runs_late_is_shed(node_access, redis_server):
    # The 15-minute soak at ac4a398: at cold start the key look-ups were shed, but the
    # team look-up after them still told three clients the quota store was down.
    access, redis = node_access
    key, _ = await KeyStore(redis).create("cold-member")
    members = [key.model_copy(update={"team": (await TeamStore(redis).create(name)).id}) for name in "ab"]
    punctual, late = await punctual_then_late(access, redis_server, lambda n: access.authenticator.team_of(members[n]))
    assert (punctual.status, punctual.code) == (503, "quota_backend_unavailable")
    assert (late.status, late.code) == (503, "gateway_overloaded")


async def test_an_ingress_whose_loop_runs_far_behind_says_so_until_it_catches_up(redis_url):
    """quota.shed_loop_lag_s: the gate reports overload while its loop ran that late
    within the lag window, and not once the window has passed; 0 never sheds."""
    services = build_quota_services(
        AppSettings(redis_url=redis_url, quota={"shed_loop_lag_s": 0.2}), Telemetry(False, False)
    )
    never = build_quota_services(
        AppSettings(redis_url=redis_url, quota={"shed_loop_lag_s": 0}), Telemetry(False, False)
    )
    try:
        for gate in (services.gate, never.gate):
            gate.loop_lag.window_s = 1.0
            gate.loop_lag.start()
        await asyncio.sleep(0.3)
        assert not services.gate.overloaded()
        time.sleep(0.4)  # the loop stalls
        await asyncio.sleep(0.15)  # the watcher wakes, late
        assert services.gate.overloaded() and not never.gate.overloaded()
        await asyncio.sleep(1.2)  # past the window, punctual again
        assert not services.gate.overloaded()
    finally:
        await services.redis.aclose()
        await never.redis.aclose()


# -- authentication against hostile headers -------------------------------------------


async def test_random_bearer_tokens_leave_the_key_cache_bounded(redis_url):
    from serve_app.identity.key_cache import NEGATIVE_MAX

    services = build_quota_services(
        AppSettings(redis_url=redis_url, quota={"redis_timeout_s": 5}), Telemetry(False, False)
    )
    try:
        for i in range(3 * NEGATIVE_MAX):
            with pytest.raises(OpenAIError) as caught:
                await services.authenticator.authenticate({"authorization": f"Bearer sk-random-{i}"})
            assert caught.value.status == 401
        assert len(services.authenticator._cache) <= NEGATIVE_MAX
    finally:
        await services.redis.aclose()


async def test_an_admin_token_header_of_any_characters_is_a_401_not_a_crash(redis_server):
    settings = AppSettings(redis_url=redis_server.url, admin_token="s3cret-admin-token-of-32-characters")
    services = build_quota_services(settings, Telemetry(False, False))
    try:
        # Starlette hands header values over as latin-1 text: any byte can arrive.
        for value in (
            "Bearer s3crét-admin-token-of-32-characters",
            "Bearer \u00ff\u00fe",
            "Bearer " + "\u00e9" * 10_000,
            "Bearer \x00",
        ):
            with pytest.raises(OpenAIError) as caught:
                await services.authenticator.admin_actor({"authorization": value})
            assert caught.value.status == 401
        assert (
            await services.authenticator.admin_actor({"authorization": "Bearer s3cret-admin-token-of-32-characters"})
            == "admin-token"
        )
    finally:
        await services.redis.aclose()


TOKEN = "s3cret-admin-token-of-32-characters"


async def test_failed_admin_credentials_are_answered_429_past_the_bound_and_the_right_one_always_passes(
    redis_server,
):
    """60 wrong admin credentials in 5 s were 60 x 401: past the minute's bound a client's
    failures are a 429 with retry-after; the right credential from that same client
    still passes (before: refused unchecked, so 20 wrong guesses from a shared address
    kept every admin out); tenant keys and identity tokens sent to the admin API are
    refused without counting; a request with no credential guesses nothing."""
    settings = AppSettings(redis_url=redis_server.url, admin_token=TOKEN, auth={"admin_failures_per_minute": 5})
    services = build_quota_services(settings, Telemetry(False, False))
    attacker = {"x-forwarded-for": "203.0.113.9"}
    try:
        tenant_shaped = ["sk-llm-" + "a" * 43, "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2ln"]
        for secret in [None] * 3 + tenant_shaped * 5:  # none of these counts
            with pytest.raises(OpenAIError) as caught:
                await services.authenticator.admin_actor(
                    {**attacker, **({"authorization": f"Bearer {secret}"} if secret else {})}
                )
            assert caught.value.status == 401
        # The count is per clock minute: near a minute's end, wait for the next one, so that
        # the guesses and the checks below (milliseconds against a local Redis) share one.
        left_s = WINDOW_S - time.time() % WINDOW_S
        if left_s < 5:
            await asyncio.sleep(left_s + 0.05)
        statuses = []
        for i in range(8):
            try:
                await services.authenticator.admin_actor({**attacker, "authorization": f"Bearer guess-{i}"})
            except OpenAIError as exc:
                statuses.append(exc.status)
                last = exc
        assert statuses == [401] * 5 + [429] * 3, statuses
        assert 1 <= int(last.headers["retry-after"]) <= 60 and "Too many failed admin credentials" in last.message
        assert (
            await services.authenticator.admin_actor({**attacker, "authorization": f"Bearer {TOKEN}"}) == "admin-token"
        )
        _, named = await services.authenticator.admins.create("ops", "admin-token")
        assert await services.authenticator.admin_actor({**attacker, "authorization": f"Bearer {named}"}) == "admin:ops"
    finally:
        await services.redis.aclose()


# -- fail_mode closed: an outage refuses, nothing is served unchecked ------------------


async def no_lease_left(client, k: KeyRecord) -> None:
    """Settlement runs as a background task: wait for it, within a bound."""
    for _ in range(100):
        if await client.zcard(redis_names.concurrency(k.id)) == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("a lease was left behind")


async def test_fail_closed_refuses_every_request_while_redis_is_down_then_recovers():
    from serve_app.identity.keys import KeyStore
    from serve_app.limits import KeyLimits

    with running_redis(persistent=True) as server:  # its own: this test stops it
        settings = AppSettings(
            redis_url=server.url, quota={"fail_mode": "closed", "key_cache_ttl_s": 0.5, "redis_timeout_s": 1}
        )
        services = build_quota_services(settings, Telemetry(False, False))
        client = aioredis.Redis.from_url(server.url)
        try:
            _, secret = await KeyStore(client).create("closed", KeyLimits(requests_per_minute=100, max_concurrent=1))
            headers = {"authorization": f"Bearer {secret}"}
            k = await services.authenticator.authenticate(headers)
            services.gate.settle(
                await services.gate.admit(k, "m", 10), "completed", Usage(prompt_tokens=1, completion_tokens=1)
            )
            await no_lease_left(client, k)
            server.stop()
            try:
                # A key still in the cache is known, but nothing is admitted on local limits ...
                with pytest.raises(OpenAIError) as refused:
                    await services.gate.admit(k, "m", 10)
                assert (refused.value.status, refused.value.code) == (503, "quota_backend_unavailable")
                assert refused.value.headers["retry-after"] == "1"
                # ... and once the cache entry is past its TTL, no stale record stands in.
                await asyncio.sleep(0.6)
                with pytest.raises(OpenAIError) as unknown:
                    await services.authenticator.authenticate(headers)
                assert (unknown.value.status, unknown.value.code) == (503, "quota_backend_unavailable")
            finally:
                server.start()
            await client.connection_pool.disconnect()  # the test's own connections died with the server
            k = await services.authenticator.authenticate(headers)
            ticket = await services.gate.admit(k, "m", 10)  # max_concurrent 1: the refused admit left no lease
            assert not ticket.local
            services.gate.settle(ticket, "completed", Usage(prompt_tokens=1, completion_tokens=1))
            while services.gate._unsettled:  # the refused admit's clean-up, retried until Redis answered
                await services.gate.flush_unsettled()
                await asyncio.sleep(0.05)
            await no_lease_left(client, k)
        finally:
            await services.redis.aclose()
            await client.aclose()


async def test_after_a_redis_restart_the_next_request_reads_redis_again():
    """A restart closes every pooled connection: the next request must open a new
    one, not fail on a dead one (a key not in the cache then got a 503, fail_mode
    open or not: redis-py 8 skipped its pool check while maintenance
    notifications were on)."""
    from serve_app.identity.keys import KeyStore
    from serve_app.limits import KeyLimits

    with running_redis(persistent=True) as server:  # its own: this test restarts it
        # No key cache: every request reads its key from Redis.
        services = build_quota_services(
            AppSettings(redis_url=server.url, quota={"redis_timeout_s": 0.3, "key_cache_ttl_s": 0}),
            Telemetry(False, False),
        )
        client = aioredis.Redis.from_url(server.url)
        try:
            _, secret = await KeyStore(client).create("before", KeyLimits(requests_per_minute=1000))
            k = await services.authenticator.authenticate({"authorization": f"Bearer {secret}"})
            tickets = await asyncio.gather(
                *(services.gate.admit(k, "m", 10) for _ in range(8))
            )  # several pooled connections
            for ticket in tickets:
                services.gate.settle(ticket, "completed", Usage(prompt_tokens=1, completion_tokens=1))
            await no_lease_left(client, k)
            server.stop()
            server.start()
            await asyncio.sleep(0.2)  # the event loop sees the old connections close, as a serving ingress does
            await client.connection_pool.disconnect()
            _, fresh = await KeyStore(client).create("after", KeyLimits(requests_per_minute=1000))
            for _ in range(8):  # every pooled connection is tried: none may be a dead one
                after = await services.authenticator.authenticate({"authorization": f"Bearer {fresh}"})
                ticket = await services.gate.admit(after, "m", 10)
                assert not ticket.local  # admitted by Redis, not by the fail-open fallback
                services.gate.settle(ticket, "completed", Usage(prompt_tokens=1, completion_tokens=1))
            await no_lease_left(client, after)
        finally:
            await services.redis.aclose()
            await client.aclose()


async def test_authentication_says_where_the_key_record_came_from(redis_url):
    from serve_app.identity.keys import KeyStore

    services = build_quota_services(
        AppSettings(redis_url=redis_url, quota={"key_cache_ttl_s": 60}), Telemetry(False, False)
    )
    try:
        _, secret = await KeyStore(services.redis).create("traced-auth")
        sources = []
        for _ in range(2):
            seen: dict[str, str] = {}
            await services.authenticator.authenticate({"authorization": f"Bearer {secret}"}, seen)
            sources.append(seen["source"])
        assert sources == ["redis", "cache"]  # a trace's authenticate span says which
    finally:
        await services.redis.aclose()
