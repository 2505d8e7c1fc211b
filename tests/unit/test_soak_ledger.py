"""The soak's ledger (soak/ledger.py) judges histories it is handed: shown here to
pass what a correct admission produces, for any arrivals, and to fail what a broken
one produces (limits read from a stale copy, each replica counting alone as
LiteLLM's pods do), a lost or doubled record, a wrong charge, a leaked slot, a 5xx
outside a fault."""

from __future__ import annotations

import dataclasses
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from soak.ledger import (
    Account,
    Fault,
    Limits,
    Observation,
    Record,
    judge,
    max_overlap,
    worst_window,
)

WINDOW_MS = 60_000


def brute_worst(times, weights, limit):
    return max(
        sum(weights[i : j + 1]) - limit - limit * (times[j] - times[i]) / WINDOW_MS
        for j in range(len(times))
        for i in range(j + 1)
    )


@given(
    st.lists(st.tuples(st.integers(0, 300_000), st.integers(0, 50)), min_size=1, max_size=40),
    st.integers(1, 200),
)
def test_worst_window_is_the_brute_force_maximum(arrivals, limit):
    arrivals.sort()
    times, weights = [t for t, _ in arrivals], [w for _, w in arrivals]
    assert abs(worst_window(times, weights, limit)[0] - brute_worst(times, weights, limit)) < 1e-6


def test_max_overlap_counts_spans_open_at_once_and_a_handover_as_none():
    assert max_overlap([(0, 10), (5, 15), (10, 20)])[0] == 2
    assert max_overlap([(0, 10), (10, 20), (20, 30)])[0] == 1


class Gcra:
    """The admission's rule (admit.lua, settle.lua) in Python: GCRA over 60 s per
    account for requests and tokens, tokens reserved then settled to their use."""

    def __init__(self):
        self.tat: dict[tuple[str, str], float] = {}

    def admit(self, account: str, kind: str, now: float, cost: float, limit: int) -> bool:
        if not limit:
            return True
        tat = max(self.tat.get((account, kind), now), now)
        new = tat + cost * WINDOW_MS / limit
        if new - now > WINDOW_MS:
            return False
        self.tat[(account, kind)] = new
        return True

    def refund(self, account: str, unused: float, limit: int) -> None:
        if limit and (account, "tokens") in self.tat:
            self.tat[(account, "tokens")] -= unused * WINDOW_MS / limit


def simulate(seed: int, stale_limits: bool = False, replicas_count_alone: int = 0, alone_is_local: bool = False):
    """Arrivals on 2 keys of one team; key-a's limits are lowered at 100 s. Returns
    the ledger's accounts, records and observations. ``stale_limits``: the admission
    goes on with the limits before the change; ``replicas_count_alone``: that many
    replicas each keep their own state (N × the limit), with ``alone_is_local`` as
    fail-open ingresses do while Redis is unreachable (their records say so)."""
    rng = random.Random(seed)
    before = Limits(requests_per_minute=30, tokens_per_minute=3000, max_concurrent=4)
    after = Limits(requests_per_minute=6, tokens_per_minute=600, max_concurrent=1)
    changed_ms = 100_000
    states = [Gcra() for _ in range(max(replicas_count_alone, 1))]
    records, observations, running = [], [], []
    for n, now in enumerate(sorted(rng.uniform(0, 200_000) for _ in range(1200))):
        key = rng.choice(["key-a", "key-b"])
        limits = after if key == "key-a" and now >= changed_ms and not stale_limits else before
        state = states[n % len(states)]
        reserve, use = rng.randint(10, 200), 0
        use = rng.randint(1, reserve)
        duration = rng.uniform(50, 3000)
        busy = [span for span in running if span[0] == key and span[1] <= now < span[2]]
        admitted = (
            len(busy) < limits.max_concurrent
            and state.admit(key, "requests", now, 1, limits.requests_per_minute)
            and state.admit(key, "tokens", now, reserve, limits.tokens_per_minute)
        )
        http_id = f"r{n}"
        if admitted:
            state.refund(key, reserve - use, limits.tokens_per_minute)
            running.append((key, now, now + duration))
            local = alone_is_local and n % len(states) != 0
            records.append(
                Record(
                    http_id, key, "completed", int(now), int(now + duration), use, reserve, 0, http_id, use, 0, local
                )
            )
            observations.append(Observation(http_id, key, int(now), int(now + duration), 200, "", use, 0))
        else:
            observations.append(Observation(http_id, key, int(now), int(now) + 1, 429, "rate_limit_exceeded"))
    accounts = [
        Account("key-a", [(0, before), (changed_ms, after)]),
        Account("key-b", [(0, before)]),
    ]
    return accounts, records, observations


def verdict_of(accounts, records, observations, faults=(), running=None):
    return judge(accounts, records, observations, list(faults), running or {}, {"key-a", "key-b"})


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_a_correct_admission_passes_for_any_arrivals(seed):
    verdict = verdict_of(*simulate(seed))
    assert verdict.passed, verdict.violations[:3]


def test_limits_read_from_a_stale_copy_are_caught_on_the_lowered_key():
    verdict = verdict_of(*simulate(1, stale_limits=True))
    failed = {(v.check, v.subject) for v in verdict.violations}
    assert ("requests_per_minute", "key-a") in failed
    assert ("max_concurrent", "key-a") in failed
    assert not any(subject == "key-b" for _, subject in failed)  # its limits never changed


def test_replicas_counting_alone_admit_a_multiple_of_the_limit_and_are_caught():
    verdict = verdict_of(*simulate(2, replicas_count_alone=4))
    assert {v.check for v in verdict.violations} >= {"requests_per_minute", "tokens_per_minute"}


def test_local_admissions_in_a_redis_fault_are_overshoot_and_outside_one_a_failure():
    accounts, records, observations = simulate(3, replicas_count_alone=4, alone_is_local=True)
    fault = Fault("redis-primary-kill", 0, 200_000, touches_redis=True)
    verdict = verdict_of(accounts, records, observations, [fault])
    assert verdict.passed, verdict.violations[:3]
    assert verdict.overshoot["requests_per_minute"] and verdict.overshoot["tokens_per_minute"]
    # A fault that is not Redis' (an ingress killed) excuses no admission without Redis.
    verdict = verdict_of(accounts, records, observations, [Fault("ingress-kill", 0, 200_000)])
    assert {v.check for v in verdict.violations} == {"local admission"}

    # A slow Redis path the probe saw excuses the admissions within its own short grace only.
    slow = Fault("redis-slow (observed)", 0, 100_000, touches_redis=True, observed=True, grace_ms=5_000)
    verdict = verdict_of(accounts, records, observations, [slow])
    late = [r for r in records if r.local and r.admitted_ms > 105_000]
    assert late and {v.check for v in verdict.violations} == {"local admission"}
    assert len(verdict.violations) == len(late)


def test_what_redis_admitted_is_held_exact_even_inside_a_redis_fault():
    accounts, records, observations = simulate(3, replicas_count_alone=4)  # not marked local: Redis' own
    fault = Fault("redis-primary-kill", 0, 200_000, touches_redis=True)
    verdict = verdict_of(accounts, records, observations, [fault])
    assert {"requests_per_minute", "tokens_per_minute"} <= {v.check for v in verdict.violations}


def test_a_lost_record_a_doubled_admission_a_wrong_charge_and_a_recorded_refusal_are_caught():
    accounts, records, observations = simulate(4)
    admitted = [r for r in records]
    lost, doubled, wrong = admitted[0], admitted[1], admitted[2]
    broken = [r for r in records if r is not lost]
    broken.append(
        Record(
            "another-id",
            doubled.account,
            "completed",
            doubled.admitted_ms,
            doubled.finished_ms,
            1,
            10,
            0,
            doubled.http_request_id,
            1,
            0,
        )
    )
    broken[broken.index(wrong)] = Record(
        wrong.id,
        wrong.account,
        "completed",
        wrong.admitted_ms,
        wrong.finished_ms,
        wrong.charged_tokens,
        wrong.reserved_tokens,
        0,
        wrong.http_request_id,
        (wrong.prompt_tokens or 0) + 1,
        0,
    )
    refused = next(o for o in observations if o.status == 429)
    broken.append(
        Record(
            "ghost",
            refused.key,
            "completed",
            refused.started_ms,
            refused.ended_ms,
            1,
            1,
            0,
            refused.http_request_id,
            1,
            0,
        )
    )
    verdict = verdict_of(accounts, broken, observations)
    details = " ".join(v.detail for v in verdict.violations)
    checks = {v.check for v in verdict.violations}
    assert {"one record", "charge", "refused"} <= checks
    assert lost.http_request_id in details and doubled.http_request_id in details


def test_a_request_sent_to_another_replica_passes_with_one_record_and_is_caught_with_two():
    """Issue 78: a request retried elsewhere has one final record (its failover field
    says where it went), charged what its client saw; a second record of it (admitted
    again, charged twice) is a failure."""
    accounts, records, observations = simulate(5)
    first = records[0]
    retried = dataclasses.replace(first, failover="replica-1:died")
    verdict = verdict_of(accounts, [retried, *records[1:]], observations)
    assert verdict.passed and verdict.counts["retried elsewhere, one record and one charge"] == 1
    again = dataclasses.replace(retried, id="another-id")
    verdict = verdict_of(accounts, [retried, again, *records[1:]], observations)
    assert any(v.check == "one record" and first.http_request_id in v.detail for v in verdict.violations)


def test_a_charge_past_its_reservation_an_open_record_and_a_leaked_slot_are_caught():
    accounts, records, observations = simulate(5)
    first = records[0]
    records[0] = Record(
        first.id,
        first.account,
        "running",
        first.admitted_ms,
        first.finished_ms,
        first.reserved_tokens + 1,
        first.reserved_tokens,
        0,
        first.http_request_id,
        first.prompt_tokens,
        0,
    )
    verdict = verdict_of(accounts, records, observations, running={"key-a": 1, "key-b": 0})
    assert {"reservation", "open record", "leaked slot"} <= {v.check for v in verdict.violations}


def test_failures_outside_every_fault_window_are_caught_and_inside_one_timed():
    accounts, records, observations = simulate(6)
    failures = [
        Observation("x1", "key-a", 10_000, 10_500, 502),
        Observation("x2", "key-a", 50_000, 50_100, 0, "ServerDisconnectedError"),
        Observation("x3", "key-b", 150_000, 150_900, 200, "cut", streaming=True),
        Observation("x4", "key-b", 160_000, 160_010, 503, "model_overloaded"),  # load shed: designed
    ]
    faults = [Fault("ingress-kill", 49_000, 55_000)]
    verdict = verdict_of(accounts, records, observations + failures, faults)
    outside = {v.detail.split(":")[0] for v in verdict.violations if v.check == "availability"}
    assert outside == {"x1", "x3"}
    assert verdict.recovery_ms["ingress-kill@49000"] == [1100]


def test_a_fault_the_system_did_not_recover_from_in_its_bound_is_caught():
    accounts, records, observations = simulate(5)
    stuck = Fault("model-kill", 10_000, 310_000, undone=False)
    verdict = verdict_of(accounts, records, observations, [stuck])
    assert [(v.check, v.subject) for v in verdict.violations] == [("recovery", "model-kill")]


def test_an_admission_after_a_revocation_is_caught():
    accounts, records, observations = simulate(7)
    accounts[1].revoked_ms = 150_000
    verdict = verdict_of(accounts, records, observations)
    assert any(v.check == "revocation" and v.subject == "key-b" for v in verdict.violations)


def test_a_key_admission_taken_back_after_its_teams_revocation_is_no_admission():
    """A key of a revoked team passes its own admission, then its team refuses it (401
    team_disabled) and the key's admission is withdrawn: nothing ran, nothing charged."""
    accounts, records, observations = simulate(7)
    accounts[1].revoked_ms = 150_000
    records = [r for r in records if not (r.account == "key-b" and r.admitted_ms > 150_000)]
    observations = [o for o in observations if not (o.key == "key-b" and o.started_ms > 150_000)]
    refused = Observation("refused", "key-b", 150_400, 150_420, 401, "team_disabled")
    taken_back = Record("taken-back", "key-b", "withdrawn", 150_416, 150_900, 0, 0, 0, "refused")
    verdict = verdict_of(accounts, [*records, taken_back], [*observations, refused])
    assert verdict.passed, verdict.violations[:3]


def test_a_revoked_key_admitted_on_local_limits_is_held_to_the_stale_bound():
    """In a Redis fault an ingress trusts the key record it last confirmed, for at most
    quota.key_stale_max_s (docs/quotas.md): within it, overshoot; past it, a failure."""
    accounts, records, observations = simulate(8)
    accounts[1].revoked_ms = 150_000
    records = [r for r in records if not (r.account == "key-b" and r.admitted_ms > 150_000)]
    observations = [o for o in observations if not (o.key == "key-b" and o.started_ms > 150_000)]
    fault = Fault("redis-pause", 160_000, 170_000, touches_redis=True)
    late = Record("late", "key-b", "completed", 165_000, 165_100, 5, 5, 0, "late", 5, 0, local=True)
    verdict = verdict_of(accounts, records + [late], observations, [fault])
    assert verdict.passed, verdict.violations[:3]
    assert verdict.overshoot["revoked, admitted on local limits (s after)"] == [15.0]
    verdict = judge(accounts, records + [late], observations, [fault], {}, {"key-a", "key-b"}, stale_max_ms=10_000)
    assert any(v.check == "revocation" for v in verdict.violations)


def test_tombstones_and_a_routes_own_429_are_no_admission_and_no_lost_refusal():
    # A withdrawn record outside any fault (a request shed, or taken back) admitted
    # nothing; a 429 too_many_active_batches answers a request its key was admitted for
    # (its record final, charged nothing), unlike a quota's 429, which stores nothing.
    accounts, records, observations = simulate(5)  # long over by 10**9 ms
    tombstone = Record("tomb", "key-a", "withdrawn", 10**9, 10**9, 0, 0, 0, local=True)
    # A request whose client left while its admission was on the wire, taken back before
    # Redis saw the admission: cancelled, never admitted there (settle.lua: admission 'none').
    taken_back = Record("gone", "key-a", "cancelled", 0, 10**9, 0, 0, 0, unadmitted=True)
    batch_refused = Observation("soak-batch", "key-a", 10**9, 10**9 + 10, 429, "too_many_active_batches")
    its_record = Record("batch-rec", "key-a", "failed", 10**9 + 1, 10**9 + 5, 0, 0, 0, "soak-batch")
    verdict = verdict_of(accounts, [*records, tombstone, taken_back, its_record], [*observations, batch_refused])
    assert verdict.passed, verdict.violations[:3]
    as_local = Record("gone", "key-a", "cancelled", 0, 10**9, 0, 0, 0, local=True)  # as it was written before
    verdict = verdict_of(accounts, [*records, as_local], observations)
    assert {v.check for v in verdict.violations} == {"local admission"}
    quota_refused = Observation("soak-quota", "key-a", 10**9, 10**9 + 10, 429, "rate_limit_exceeded")
    recorded = Record("quota-rec", "key-a", "failed", 10**9 + 1, 10**9 + 5, 0, 0, 0, "soak-quota")
    verdict = verdict_of(accounts, [*records, recorded], [*observations, quota_refused])
    assert {v.check for v in verdict.violations} == {"refused"}


def test_an_abandoned_charge_passes_only_when_its_settlement_met_a_redis_fault():
    # A replica that cannot settle for the rest of a lease (Redis paused, its own loop
    # late) is, to the reaper, a dead one's: finalised abandoned, charged its reservation.
    # The documented charge within a Redis fault's window; anywhere else a lost settlement.
    accounts, records, observations = simulate(7)
    shown = {o.http_request_id: o for o in observations if o.status == 200 and o.prompt_tokens is not None}
    served = next(r for r in records if r.http_request_id in shown and r.account == shown[r.http_request_id].key)
    seen = shown[served.http_request_id]
    abandoned = Record(
        served.id,
        served.account,
        "abandoned",
        served.admitted_ms,
        seen.ended_ms + 60_000,
        served.reserved_tokens,
        served.reserved_tokens,
        0,
        served.http_request_id,
    )
    records = [abandoned if r is served else r for r in records]
    pause = Fault("redis-pause", seen.ended_ms - 1_000, seen.ended_ms + 3_000, touches_redis=True)
    assert verdict_of(accounts, records, observations, [pause]).passed
    for faults in ([], [Fault("ingress-kill", seen.ended_ms - 1_000, seen.ended_ms + 3_000)]):
        verdict = verdict_of(accounts, records, observations, faults)
        assert {v.check for v in verdict.violations} == {"charge"}, verdict.violations[:3]


def test_a_missing_record_passes_only_for_a_local_admission_whose_ingress_was_killed():
    # Admitted on local limits in a Redis fault, its record lives only in its ingress
    # until its settlement reaches Redis: an ingress killed before then takes it along
    # (docs/quotas.md, "When a primary dies"). Either fault alone: a lost record.
    accounts, records, observations = simulate(4)
    seen = next(o for o in observations if o.status == 200)
    records = [r for r in records if r.http_request_id != seen.http_request_id or r.account != seen.key]
    failover = Fault("redis-primary-kill", seen.started_ms - 2_000, seen.started_ms + 3_000, touches_redis=True)
    kill = Fault("ingress-kill", seen.ended_ms - 100, seen.ended_ms + 10_000)
    verdict = verdict_of(accounts, records, observations, [failover, kill])
    assert not [v for v in verdict.violations if v.check == "one record"], verdict.violations[:3]
    assert verdict.counts["records lost: admitted on local limits, ingress killed before Redis took them"] == 1
    late_kill = Fault("ingress-kill", seen.ended_ms + 60_000, seen.ended_ms + 70_000)
    for faults in ([failover], [kill], [failover, late_kill]):
        verdict = verdict_of(accounts, records, observations, faults)
        assert any(v.check == "one record" and seen.http_request_id in v.detail for v in verdict.violations)


def test_a_dying_primarys_unreplicated_admissions_are_overshoot_within_those_in_flight():
    """Redis replicates asynchronously: a primary killed may take along admissions it had
    acknowledged, at most the requests in flight then (docs/quotas.md, "When a primary
    dies"), so the new primary may admit that many again. Within that: overshoot; past it,
    or with no primary killed: a failure. (A soak run of 2026-12-02 had a key of 30/min
    admit a fraction of a request past its allowance 145 ms into a primary's kill.)"""
    limit = 10
    account = Account("key-a", [(0, Limits(requests_per_minute=limit))])
    # The burst the limit allows, then one more the new primary admits 0.2 s after the kill.
    burst = [Record(f"r{n}", "key-a", "completed", 1_000 + n, 3_000, 1, 1, 0, f"h{n}", 1, 0) for n in range(limit)]
    extra = Record("again", "key-a", "completed", 2_200, 2_300, 1, 1, 0, "again", 1, 0)
    records = [*burst, extra]
    observations = [
        Observation(r.http_request_id, "key-a", r.admitted_ms, r.finished_ms, 200, "", 1, 0) for r in records
    ]

    def verdict(faults):
        return judge([account], records, observations, faults, {}, {"key-a"})

    killed = Fault("redis-primary-kill", 2_000, 6_000, touches_redis=True)
    within = verdict([killed])
    assert within.passed, within.violations[:3]
    assert within.overshoot["requests_per_minute"]
    assert {v.check for v in verdict([]).violations} == {"requests_per_minute"}  # no primary died
    assert {v.check for v in verdict([Fault("ingress-kill", 2_000, 6_000)]).violations} == {"requests_per_minute"}
    # Killed after every request ended: nothing was in flight to lose.
    assert {v.check for v in verdict([Fault("redis-primary-kill", 3_100, 6_000, touches_redis=True)]).violations} == {
        "requests_per_minute"
    }
