"""The soak's verdict: what was admitted, charged, recorded and left, checked
against every limit, Jepsen-style, from three independent sources: the final
request records (Redis and the record sink), Redis at rest, and what every client
saw. Pure: the harness (soak/harness.py) gathers the history, this judges it, and
tests/unit/test_soak_ledger.py shows it failing on a broken admission.

The bounds it holds the gateway to are docs/quotas.md's:
- requests/min and tokens/min (GCRA over 60 s): over any s seconds an account is
  charged at most L + L·s/60, by the time each request was admitted, with each
  period of one limit judged on its own (a limit changed mid-run starts a period when
  the change returned);
- concurrency: requests running at once, by their records' admitted→finished spans;
- daily token and money budgets: what a UTC day charged;
- exactly, for every request Redis admitted, whatever the faults: Redis holds each
  limit atomically, so the records it admitted keep every limit with no overshoot;
- the requests admitted without Redis (fail_mode open: each ingress its share of the
  limits, budgets not enforced; and those whose admission a dying primary lost, whose
  settlement then writes their record as such) are the faults' overshoot: each must lie
  in a Redis fault's window, and what they add over a limit is reported per limit.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

WINDOW_MS = 60_000
CLOCK_MS = 2  # what the records' millisecond times may each be off by (truncated)
# Load shed by design (503 with retry-after): a model's queue full; an ingress too
# overloaded to hear Redis in time (serve_app/admission/loop_lag.py).
SHED = frozenset({"model_overloaded", "gateway_overloaded"})
# A 429 of the quotas stores nothing; another 429 (too_many_active_batches) is a route's
# answer to a request its key was admitted for: its record is final, charged nothing.
QUOTA_REFUSALS = frozenset({"rate_limit_exceeded", "insufficient_quota"})
FINAL = frozenset({"completed", "failed", "cancelled", "overloaded", "abandoned", "withdrawn"})
# How late after its answer a request admitted on local limits may reach Redis: the
# ingress' maintenance tick (1 s) that flushes settlements, late on a loaded replica.
LOCAL_SETTLE_MS = 5_000
# How long after the harness stamps a primary's kill the SIGKILL may land: admissions the
# dying primary acknowledged meanwhile are among those it may not have replicated.
KILL_LANDS_MS = 500


@dataclass(frozen=True)
class Limits:
    """One account's limits over one period (0: none)."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrent: int = 0
    daily_token_budget: int = 0
    daily_cost_nanos: int = 0


@dataclass
class Account:
    """A key or a team, with its limits as the harness set them: ``periods`` are
    (from_ms, Limits), the first from 0; ``revoked_ms`` when its revocation returned."""

    id: str
    periods: list[tuple[int, Limits]]
    revoked_ms: int | None = None

    def limits_at(self, ms: int) -> Limits:
        starts = [start for start, _ in self.periods]
        return self.periods[bisect.bisect_right(starts, ms) - 1][1]


@dataclass(frozen=True)
class Record:
    """A final request record, at one level (a key's or its team's account)."""

    id: str
    account: str
    status: str
    admitted_ms: int
    finished_ms: int
    charged_tokens: int
    reserved_tokens: int
    cost_nanos: int
    http_request_id: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    local: bool = False  # admitted without Redis (its record written by its settlement)
    # Never admitted at this level: its settlement took back an admission still on the
    # wire (its client left) and found no record (settle.lua writes admission 'none').
    unadmitted: bool = False
    failover: str = ""  # what failed it on its way before the replica that served it (issue 78)

    @property
    def admission(self) -> bool:
        """A request's admission, not a tombstone of one taken back (or never made: a
        request shed, or whose client left while its admission was on the wire)."""
        return self.status != "withdrawn" and not self.unadmitted


@dataclass(frozen=True)
class Observation:
    """What one client saw of one request."""

    http_request_id: str
    key: str
    started_ms: int
    ended_ms: int
    status: int  # 0: no HTTP answer (connection refused, reset, timed out)
    code: str = ""  # the error's code, or 'cut' for a stream that ended without [DONE]
    prompt_tokens: int | None = None  # the usage the client was shown, when it was
    completion_tokens: int | None = None
    streaming: bool = False
    message: str = ""  # a 5xx's error message, kept to read a verdict by


@dataclass(frozen=True)
class Fault:
    kind: str
    started_ms: int
    healed_ms: int  # when the harness undid it (the process back, the proxy clean)
    touches_redis: bool = False
    # Not injected but seen: the Redis path slower than the gateway's shedding bound
    # (soak/redis_probe.py). It excuses what a slow Redis causes, for its own grace.
    observed: bool = False
    grace_ms: int | None = None  # None: the ledger's
    undone: bool = True  # False: the system had not recovered when the harness gave up on it

    def until_ms(self, grace_ms: int) -> int:
        """The end of its window: when it was undone, and the grace to recover."""
        return self.healed_ms + (grace_ms if self.grace_ms is None else self.grace_ms)


@dataclass
class Violation:
    check: str
    subject: str
    detail: str


@dataclass
class Verdict:
    violations: list[Violation] = field(default_factory=list)
    overshoot: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    counts: collections.Counter = field(default_factory=collections.Counter)
    recovery_ms: dict[str, list[int]] = field(default_factory=lambda: collections.defaultdict(list))
    run_folder: str = ""  # where the harness kept what was judged

    @property
    def passed(self) -> bool:
        return not self.violations

    def fail(self, check: str, subject: str, detail: str) -> None:
        self.violations.append(Violation(check, subject, detail))


def worst_window(times_ms: list[int], weights: list[int], limit: int) -> tuple[float, int, int]:
    """The most any window of admissions exceeds GCRA's allowance L + L·s/60 by:
    max over i ≤ j of (sum of weights i..j) − L − L·(t_j − t_i)/60 s, in O(n).
    Returns (excess, t_i, t_j); excess ≤ 0 means the limit held."""
    best, best_span = float("-inf"), (0, 0)
    prefix = 0.0  # sum of weights before i
    top, top_t = float("-inf"), 0  # max over i ≤ j of L·t_i/60s − prefix_before_i
    for t, weight in zip(times_ms, weights):
        candidate = limit * t / WINDOW_MS - prefix
        if candidate > top:
            top, top_t = candidate, t
        prefix += weight
        excess = prefix + top - limit * t / WINDOW_MS - limit
        if excess > best:
            best, best_span = excess, (top_t, t)
    return best, best_span[0], best_span[1]


def max_overlap(spans: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """Most spans [start, end) open at once, and when. A span ending when another
    starts does not overlap it (the slot was released first)."""
    spans = list(spans)
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans], key=lambda e: (e[0], e[1]))
    running = most = 0
    at = 0
    for t, step in events:
        running += step
        if running > most:
            most, at = running, t
    return most, at


def _in_faults(start_ms: int, end_ms: int, faults: Sequence[Fault], grace_ms: int, redis_only: bool) -> bool:
    return any(
        fault.started_ms <= end_ms and start_ms <= fault.until_ms(grace_ms)
        for fault in faults
        if fault.touches_redis or not redis_only
    )


def _local_record_lost_with_its_ingress(seen: Observation, faults: Sequence[Fault], grace_ms: int) -> bool:
    """Whether a request's missing record is the documented loss of fail-open
    (docs/quotas.md, "When a primary dies"): admitted on local limits while Redis
    failed, its record lives only in its ingress until its settlement reaches Redis (the
    next maintenance tick once Redis answers), so an ingress killed before then takes
    it along. The ledger cannot tell which ingress served it: it needs both a Redis
    fault over the request and an ingress killed between its start and its settlement's
    last chance (the run of 2026-12-01 lost one: admitted 3 s into a primary's
    failover, its stream ended 0.1 s after its ingress was killed)."""
    if not _in_faults(seen.started_ms, seen.ended_ms, faults, grace_ms, redis_only=True):
        return False
    return any(
        fault.kind == "ingress-kill" and seen.started_ms <= fault.started_ms <= seen.ended_ms + LOCAL_SETTLE_MS
        for fault in faults
    )


def _unreplicated(records: list[Record], weight, start_ms: int, end_ms: int, faults: Sequence[Fault]) -> float:
    """What a window of Redis' admissions may hold past the limit through a primary's
    death (docs/quotas.md, "When a primary dies"): the admissions it acknowledged but had
    not replicated, at most the requests in flight when it died (admitted by the time the
    kill landed, not yet ended), for each primary killed within the window's reach."""
    lost = 0.0
    for fault in faults:
        if fault.kind != "redis-primary-kill" or not start_ms - WINDOW_MS <= fault.started_ms <= end_ms:
            continue
        landed = fault.started_ms + KILL_LANDS_MS
        lost += sum(weight(r) for r in records if r.admitted_ms <= landed and r.finished_ms >= fault.started_ms)
    return lost


def _periods(account: Account, records: list[Record]) -> Iterable[tuple[Limits, list[Record]]]:
    starts = [start for start, _ in account.periods]
    grouped: dict[int, list[Record]] = collections.defaultdict(list)
    for record in records:
        grouped[bisect.bisect_right(starts, record.admitted_ms) - 1].append(record)
    for index, members in grouped.items():
        yield account.periods[index][1], sorted(members, key=lambda r: r.admitted_ms)


def check_limits(verdict: Verdict, account: Account, records: list[Record], faults: list[Fault], grace_ms: int):
    """Every limit of one account: exact on what Redis admitted; what was admitted
    without Redis lies in a Redis fault's window, and what it adds is the overshoot."""
    records = [record for record in records if record.admission]
    for record in records:
        if record.local and not _in_faults(record.admitted_ms, record.admitted_ms, faults, grace_ms, redis_only=True):
            verdict.fail("local admission", account.id, f"{record.id} admitted without Redis, no Redis fault")
    for limits, members in _periods(account, records):
        by_redis = [record for record in members if not record.local]
        for name, limit, weight in (
            ("requests_per_minute", limits.requests_per_minute, lambda r: 1),
            ("tokens_per_minute", limits.tokens_per_minute, lambda r: r.charged_tokens),
        ):
            if not limit:
                continue
            verdict.counts[f"limits checked: {name}"] += 1
            excess, start, end = worst_window([r.admitted_ms for r in by_redis], [weight(r) for r in by_redis], limit)
            if excess > limit * CLOCK_MS / WINDOW_MS:
                unreplicated = _unreplicated(by_redis, weight, start, end, faults)
                if excess > unreplicated + limit * CLOCK_MS / WINDOW_MS:
                    verdict.fail(name, account.id, f"{excess:.2f} over {limit} in {start}..{end} ms, admitted by Redis")
                else:  # docs/quotas.md, "When a primary dies": Redis replicates asynchronously
                    verdict.counts[f"{name}: a dying primary's unreplicated admissions"] += 1
                    verdict.overshoot[name].append(excess / limit)
            overall, _, _ = worst_window([r.admitted_ms for r in members], [weight(r) for r in members], limit)
            if overall > limit * CLOCK_MS / WINDOW_MS:
                verdict.overshoot[name].append(overall / limit)
        if limits.max_concurrent:
            verdict.counts["limits checked: max_concurrent"] += 1
            for subset, strict in ((by_redis, True), (members, False)):
                running, at = max_overlap(
                    (record.admitted_ms, record.finished_ms) for record in subset if record.status != "abandoned"
                )
                if running <= limits.max_concurrent:
                    continue
                if strict:
                    verdict.fail(
                        "max_concurrent", account.id, f"{running} running at {at} ms > {limits.max_concurrent}"
                    )
                else:
                    verdict.overshoot["max_concurrent"].append(
                        (running - limits.max_concurrent) / limits.max_concurrent
                    )
        by_day: dict[int, list[Record]] = collections.defaultdict(list)
        for record in members:
            by_day[record.admitted_ms // 86_400_000].append(record)
        for day, spent in by_day.items():
            for name, budget, used in (
                ("daily_token_budget", limits.daily_token_budget, lambda rs: sum(r.charged_tokens for r in rs)),
                ("daily_cost_budget", limits.daily_cost_nanos, lambda rs: sum(r.cost_nanos for r in rs)),
            ):
                if not budget:
                    continue
                if used([r for r in spent if not r.local]) > budget:
                    verdict.fail(name, account.id, f"day {day}: {used(spent)} charged > {budget}, admitted by Redis")
                if used(spent) > budget:
                    verdict.overshoot[name].append((used(spent) - budget) / budget)


def check_revocation(
    verdict: Verdict, account: Account, records: list[Record], faults, grace_ms, cache_ttl_ms, stale_max_ms
):
    """No admission through Redis after a revocation returned (the admission script
    reads the key itself). On local limits, in a Redis fault, an ingress trusts the key
    record it last confirmed, for at most ``quota.key_stale_max_s`` (docs/quotas.md): an
    ingress that had not read the key since its revocation admits it until then. Every
    request running at the revocation ends within the check that stops it."""
    if account.revoked_ms is None:
        return
    for record in records:
        if not record.admission:  # taken back (its team refused it) or never made: nothing ran
            continue
        if record.admitted_ms > account.revoked_ms:
            late = record.admitted_ms - account.revoked_ms
            in_fault = _in_faults(record.admitted_ms, record.admitted_ms, faults, 0, True)
            if record.local and in_fault and late <= stale_max_ms:
                verdict.overshoot["revoked, admitted on local limits (s after)"].append(late / 1000)
            else:
                verdict.fail("revocation", account.id, f"{record.id} admitted {late} ms after the revocation")
        elif record.finished_ms > account.revoked_ms + 2 * cache_ttl_ms + grace_ms:
            verdict.fail(
                "revocation",
                account.id,
                f"{record.id} still ran {record.finished_ms - account.revoked_ms} ms after the revocation",
            )


def check_records(
    verdict: Verdict,
    key_records: list[Record],
    observations: list[Observation],
    faults: Sequence[Fault] = (),
    grace_ms: int = 30_000,
) -> None:
    """Every request a client saw admitted has exactly one final record, charged what
    the client was shown; a request the client saw refused by a quota has none;
    nothing is charged beyond its reservation."""
    by_http: dict[str, list[Record]] = collections.defaultdict(list)
    for record in key_records:
        if record.admission:  # not a tombstone of an admission taken back
            by_http[record.http_request_id].append(record)
        if record.status not in FINAL:
            verdict.fail("open record", record.account, f"{record.id} is still {record.status!r} at rest")
        if record.charged_tokens > record.reserved_tokens:
            verdict.fail(
                "reservation", record.account, f"{record.id} charged {record.charged_tokens} > {record.reserved_tokens}"
            )
    for seen in observations:
        found = by_http.get(seen.http_request_id, [])
        if len(found) > 1:
            verdict.fail("one record", seen.key, f"{seen.http_request_id}: {len(found)} records")
        if seen.status == 200:
            verdict.counts["admitted (client saw 200)"] += 1
            if not found:
                if _local_record_lost_with_its_ingress(seen, faults, grace_ms):
                    verdict.counts["records lost: admitted on local limits, ingress killed before Redis took them"] += 1
                else:
                    verdict.fail("one record", seen.key, f"{seen.http_request_id}: admitted, no final record")
                continue
            record = found[0]
            if seen.prompt_tokens is not None and seen.code != "cut":
                shown = (seen.prompt_tokens, seen.completion_tokens)
                if (
                    record.status == "abandoned"
                    and record.prompt_tokens is None
                    and _in_faults(seen.ended_ms, seen.ended_ms, faults, grace_ms, redis_only=True)
                ):
                    # Its settlement met a Redis fault and outlasted its lease: finalised
                    # by the reaper, charged its reservation (docs/quotas.md, "Concurrency
                    # slots are leases"); never past it (checked above).
                    verdict.counts["charged their reservation: settlement lost in a Redis fault"] += 1
                elif (record.prompt_tokens, record.completion_tokens) != shown:
                    verdict.fail(
                        "charge",
                        seen.key,
                        f"{seen.http_request_id}: client saw {shown}, record {record.id} ({record.status}) charged "
                        f"{(record.prompt_tokens, record.completion_tokens)}",
                    )
                else:
                    verdict.counts["charges matched to the token"] += 1
                    if record.failover:  # sent to another replica: still one record, one charge
                        verdict.counts["retried elsewhere, one record and one charge"] += 1
        elif seen.status == 429 and seen.code in QUOTA_REFUSALS and found:
            verdict.fail(
                "refused", seen.key, f"{seen.http_request_id}: refused (429) yet recorded as {found[0].status}"
            )


def check_errors(verdict: Verdict, observations: list[Observation], faults: list[Fault], grace_ms: int) -> None:
    """No 5xx or lost connection outside a fault's window; each window's recovery:
    from the fault to the last failure it caused (a failure belongs to the latest fault
    begun before it ended)."""
    for seen in observations:
        if seen.status == 503 and seen.code in SHED:  # designed, with retry-after: not a failure
            verdict.counts[f"shed under load (503 {seen.code}, retry-after)"] += 1
            continue
        failed = (
            seen.status == 0
            or seen.status >= 500
            or seen.code == "not-the-gateway"  # e.g. a 404 of an edge whose routes are not loaded yet
            or (seen.status == 200 and seen.code == "cut")
        )
        if not failed:
            continue
        verdict.counts["failures seen by clients"] += 1
        hit = [f for f in faults if f.started_ms <= seen.ended_ms and seen.started_ms <= f.until_ms(grace_ms)]
        if not hit:
            verdict.fail(
                "availability",
                seen.key,
                f"{seen.http_request_id}: {seen.status} {seen.code} at {seen.started_ms}..{seen.ended_ms} ms, "
                f"no fault{': ' + seen.message if seen.message else ''}",
            )
        injected = [f for f in hit if not f.observed]
        if injected:  # the failure is the latest injected fault's that began before it ended
            fault = max(injected, key=lambda f: f.started_ms)
            verdict.recovery_ms[f"{fault.kind}@{fault.started_ms}"].append(max(0, seen.ended_ms - fault.started_ms))


def check_at_rest(verdict: Verdict, running: dict[str, int]) -> None:
    """Every concurrency counter back to 0 once the load stopped and leases ran out."""
    for account, count in running.items():
        if count:
            verdict.fail("leaked slot", account, f"{count} slots held at rest")
    verdict.counts["accounts checked at rest"] = len(running)


def judge(
    accounts: list[Account],
    records: list[Record],
    observations: list[Observation],
    faults: list[Fault],
    running_at_rest: dict[str, int],
    key_ids: set[str],
    grace_ms: int = 30_000,
    cache_ttl_ms: int = 5_000,
    stale_max_ms: int = 300_000,
) -> Verdict:
    verdict = Verdict()
    per_account: dict[str, list[Record]] = collections.defaultdict(list)
    unique: dict[tuple[str, str], Record] = {}
    for record in records:  # the sink may hold a record twice (a shipper's retry): one is the record
        unique.setdefault((record.account, record.id), record)
    for record in unique.values():
        per_account[record.account].append(record)
    verdict.counts["final records"] = len(unique)
    for account in accounts:
        check_limits(verdict, account, per_account.get(account.id, []), faults, grace_ms)
        check_revocation(
            verdict, account, per_account.get(account.id, []), faults, grace_ms, cache_ttl_ms, stale_max_ms
        )
    check_records(verdict, [r for r in unique.values() if r.account in key_ids], observations, faults, grace_ms)
    check_errors(verdict, observations, faults, grace_ms)
    check_at_rest(verdict, running_at_rest)
    for fault in faults:
        if not fault.undone:
            given_up_s = (fault.healed_ms - fault.started_ms) / 1000
            verdict.fail("recovery", fault.kind, f"not undone {given_up_s:.0f} s after")
    verdict.counts["client observations"] = len(observations)
    return verdict


def summary(values: list[Any]) -> str:
    if not values:
        return "0"
    ordered = sorted(values)
    return f"n={len(ordered)} max={ordered[-1]:.3f} p50={ordered[len(ordered) // 2]:.3f}"
