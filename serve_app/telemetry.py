"""What the gateway tells operators about each request: one JSON access-log
line and Prometheus metrics, both from the same per-request record.

Metrics go through Ray's metrics system (``ray.util.metrics``), so every node's
Ray metrics endpoint serves them beside Ray Serve's and vLLM's; Ray prefixes
their names with ``ray_``. Labels stay low-cardinality: model, route (the API
dialect), status code, limit kind and level. Key names label the per-key metrics for a
bounded number of keys (``KeyLabels``; ``telemetry.per_key_max_keys``), team names
the per-team ones (tokens, spend, refusals) for as many teams; exact per-key and
per-team usage is in Redis (``llmctl usage``). The access log never holds prompt
or completion text.

Cost per request: a handful of metric updates and one ``json.dumps``; nothing
per streamed chunk.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from contract.replica_wire import Usage
from serve_app.ray_private import metrics_report_interval_s, record_counter

ACCESS_LOGGER = "llm_cluster.access"

# Seconds. LLM latencies span milliseconds (first token of a short prompt) to
# minutes (long generations); per-token times are milliseconds.
LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]
PER_TOKEN_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1]
ADMISSION_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5]

# A key's budget use stays on the dashboards this long after its last request.
BUDGET_SERIES_KEEP_S = 3600

# 429 `type` (serve_app.admission.seam.REFUSALS) -> the limit kind label.
LIMIT_KINDS = {
    "requests": "requests",
    "tokens": "tokens",
    "concurrency": "concurrency",
    "daily_token_budget": "budget",
    "monthly_token_budget": "budget",
    "daily_cost_budget": "budget",
    "monthly_cost_budget": "budget",
}


@dataclass
class RequestRecord:
    """One request as the access log and metrics see it, filled in as it goes."""

    route: str  # openai | azure | sagemaker | databricks
    request_id: str = ""  # Serve's x-request-id
    # What the edge named it by (accounting/usage.py ``edge_request_tag``), and how many
    # admissions took an id from it (Gateway ``_edge_id``: one per admission).
    edge_tag: str = ""
    edge_admissions: int = 0
    started: float = field(default_factory=time.monotonic)
    key_id: str = ""
    key_name: str = ""
    model: str = ""  # the configured model ("" until resolved)
    operation: str = ""
    stream: bool = False
    status: int = 0
    error_code: str | None = None
    limit: str | None = None  # which quota refused it (429)
    level: str = "key"  # and whose: the key's own, or its team's (x-ratelimit-scope)
    retry_after: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    admitted_at: float | None = None  # when the quota decision came back
    first_token_at: float | None = None
    cancelled: bool = False  # the client went away mid-stream
    in_flight: bool = False  # counted in the in-flight gauge
    team: str | None = None  # the key's team id
    tier: str = ""  # the priority tier it ran at
    trace: Any = None  # its spans (serve_app/tracing.RequestTrace), when tracing is on

    def for_key(self, key) -> None:
        """Whose request it is (a ``KeyRecord``)."""
        self.key_id, self.key_name, self.team, self.tier = key.id, key.name, key.team, key.priority

    def refused(self, status: int, code: str | None, error_type: str, headers: dict[str, str]) -> None:
        self.status, self.error_code = status, code
        self.retry_after = headers.get("retry-after")
        if status == 429:
            self.limit = LIMIT_KINDS.get(error_type, error_type)
            self.level = headers.get("x-ratelimit-scope", "key")

    def used(self, usage: Usage | None) -> None:
        if usage is not None:
            self.prompt_tokens, self.completion_tokens = usage.prompt_tokens, usage.completion_tokens


OTHER_KEYS, OTHER_TEAMS = "(other keys)", "(other teams)"

# The closed label sets of the counters that count rare events: each series exists
# at zero from the start, so a dashboard tells "none" from "not exported".
REDIS_OPERATIONS = ("authenticate", "admit", "accounting", "renew")
FALLBACK_KINDS = ("cached_key", "local_limits")
REFUSAL_LEVELS = ("key", "team")
EARLY_OUTCOMES = ("admitted", "withdrawn")
# Why a request was sent again to another replica (pipeline/gateway.py _FailedBeforeFirstByte).
RETRY_REASONS = ("died", "answered_5xx", "stalled")


def zero(counter: Counter | BatchedCounter, tags: dict[str, str]) -> None:
    """Export ``counter``'s series for ``tags`` at 0. Ray's ``Counter.inc`` refuses 0;
    its recording path (what ``inc`` calls) takes it, and the exporters then send the
    series with value 0 (pinned by tests/unit/test_telemetry.py)."""
    record_counter(counter, 0, tags)


# How often the per-request counters' sums are recorded (BatchedCounter): well within
# Ray's metrics export interval (10 s), so Prometheus sees the same series.
COUNTER_FLUSH_S = 1.0


class BatchedCounter:
    """A Ray counter whose increments are summed here and recorded once per series and
    flush (``Telemetry.flush_counters``, every ``COUNTER_FLUSH_S``): each Ray record
    validates its tags and calls into the core worker (~10 µs), and a request makes
    several (bench/gateway_capacity.py, issue 57)."""

    def __init__(self, counter: Counter):
        self.counter = counter
        self._pending: dict[tuple[tuple[str, str], ...], float] = {}

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        series = tuple(tags.items()) if tags else ()
        self._pending[series] = self._pending.get(series, 0.0) + value

    def _record(self, value: float, tags: dict[str, str] | None = None) -> None:
        record_counter(self.counter, value, tags)  # zero(): at once

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for series, value in pending.items():
            if value:
                self.counter.inc(value, tags=dict(series))


class KeyLabels:
    """API key (or team) names as metric labels, bounded: the first ``limit`` names an
    ingress replica sees keep a series of their own, every later one is counted under
    ``other``. A tenant minting keys (or a platform with thousands) then costs
    Prometheus at most ``limit`` + 1 series per metric and replica; the exact
    per-key figures stay in Redis (`llmctl usage`)."""

    def __init__(self, limit: int, other: str = OTHER_KEYS):
        self.limit, self.other = limit, other
        self._named: set[str] = set()

    def label(self, key_name: str) -> str:
        if key_name in self._named:
            return key_name
        if len(self._named) < self.limit:
            self._named.add(key_name)
            return key_name
        return self.other


class Telemetry:
    """One per ingress replica."""

    def __init__(self, per_key_metrics: bool = False, access_log: bool = True, per_key_max_keys: int = 100):
        self.per_key = per_key_metrics
        self.key_labels = KeyLabels(per_key_max_keys)
        self.team_labels = KeyLabels(per_key_max_keys, OTHER_TEAMS)
        self.access_log = _access_logger() if access_log else None
        self.requests = BatchedCounter(
            Counter(
                "llm_gateway_requests",
                "Requests answered, by model, route and HTTP status.",
                ("model", "route", "status"),
            )
        )
        self.refusals = BatchedCounter(
            Counter(
                "llm_gateway_rate_limit_refusals",
                "429s by model, the limit that refused them and its level (the key's own, or its team's).",
                ("model", "limit", "level"),
            )
        )
        # Teams (serve_app/identity/teams.py): what each charged and spent, and its keys'
        # refusals by level. Team names are bounded as key names are (KeyLabels).
        self.team_tokens = BatchedCounter(
            Counter(
                "llm_gateway_team_tokens",
                "Tokens charged to a team's keys, by kind (prompt, completion, or reserved: "
                "a stream whose usage never came) (bounded: KeyLabels).",
                ("team", "kind"),
            )
        )
        self.team_cached_tokens = BatchedCounter(
            Counter(
                "llm_gateway_team_cached_prompt_tokens",
                "Of a team's keys' prompt tokens, those the engine served from the team's prefix cache "
                "(its hit rate: this over the team's prompt tokens; what cache_isolation costs it).",
                ("team",),
            )
        )
        self.team_spend = BatchedCounter(
            Counter(
                "llm_gateway_team_spend_usd", "What a team's requests cost at their models' prices, USD.", ("team",)
            )
        )
        self.team_refusals = BatchedCounter(
            Counter(
                "llm_gateway_team_refusals",
                "429s of a team's keys, by the level that refused: the key's own limit, or the team's.",
                ("team", "level"),
            )
        )
        self.duration = Histogram(
            "llm_gateway_request_duration_seconds",
            "End-to-end request latency at the ingress.",
            LATENCY_BUCKETS,
            ("model", "route"),
        )
        self.ttft = Histogram(
            "llm_gateway_time_to_first_token_seconds", "Streams: time to the first chunk.", LATENCY_BUCKETS, ("model",)
        )
        self.tpot = Histogram(
            "llm_gateway_time_per_output_token_seconds",
            "Streams: time per output token after the first.",
            PER_TOKEN_BUCKETS,
            ("model",),
        )
        self.prompt_tokens = BatchedCounter(
            Counter("llm_gateway_prompt_tokens", "Prompt tokens of answered requests.", ("model",))
        )
        self.completion_tokens = BatchedCounter(
            Counter("llm_gateway_completion_tokens", "Completion tokens of answered requests.", ("model",))
        )
        self.in_flight = Gauge("llm_gateway_requests_in_flight", "Admitted requests not finished yet.", ("model",))
        self.admission = Histogram(
            "llm_gateway_admission_seconds", "Time of the quota decision (one Redis script call).", ADMISSION_BUCKETS
        )
        self.redis_errors = Counter(
            "llm_gateway_redis_errors", "Redis calls that failed, by operation.", ("operation",)
        )
        self.fallbacks = Counter(
            "llm_gateway_redis_fallbacks",
            "Requests decided without Redis (fail-open: cached key, local limits).",
            ("kind",),
        )
        self.disconnects = BatchedCounter(
            Counter("llm_gateway_client_disconnects", "Streams the client cancelled before the end.", ("model",))
        )
        self.early_starts = BatchedCounter(
            Counter(
                "llm_gateway_early_starts",
                "Streams sent to the engine before their admission returned "
                "(quota.overlap_admission), by outcome: admitted, or withdrawn (refused, or the client left).",
                ("model", "outcome"),
            )
        )
        self.early_counts: dict[str, int] = {"admitted": 0, "withdrawn": 0}  # the same, this process
        self.resize_count = 0  # prompts the replica rendered past their reservation, this process
        self.prompt_resizes = Counter(
            "llm_gateway_prompt_resizes",
            "Requests admitted again because their prompt rendered to more tokens "
            "than the gateway's estimate reserved (the replica refused it before the engine ran it).",
            ("model",),
        )
        # Failover (pipeline/gateway.py _call): zero in normal operation, alive under faults.
        self.failover_counts: dict[str, int] = {
            "retried": 0,
            "stalled": 0,
            "ejected": 0,
            "fell_back": 0,
        }  # this process
        self.retries = Counter(
            "llm_gateway_retries",
            "Requests sent again to another replica of their model after one failed them before "
            "their first byte, by why: died (or was draining), answered_5xx, stalled (first_token_timeout_s).",
            ("model", "reason"),
        )
        self.stalled_streams = Counter(
            "llm_gateway_stalled_streams",
            "Streams whose replica sent nothing within the model's first_token_timeout_s (aborted there).",
            ("model",),
        )
        self.ejections = Counter(
            "llm_gateway_replica_ejections",
            "Replicas taken out of their model's routing choices for failing requests in a row "
            "(failover.eject_after_failures), as this gateway process judged them.",
            ("model",),
        )
        self.model_fallbacks = Counter(
            "llm_gateway_model_fallbacks",
            "Requests answered by a fallback model because no replica of the model asked for could take them.",
            ("model", "fallback"),
        )
        self.refused_before_body = Counter(
            "llm_gateway_refused_before_body",
            "Requests refused by their key's requests/min or concurrency before their body was read "
            "(a body past ingress.room_check_bytes, or of no declared length).",
            ("limit",),
        )
        self.refused_before_body_count = 0  # the same, this process
        self.answered_counts: collections.Counter[str] = collections.Counter()  # requests by route, this process
        # Final request records on their way to the record sink (accounting/record_shipper.py).
        self.record_backlog = Gauge(
            "llm_gateway_request_records_backlog",
            "Final request records waiting in Redis for the record sink (records.max_backlog refuses new requests).",
        )
        self.records_written = BatchedCounter(
            Counter("llm_gateway_request_records_shipped", "Final request records written to the record sink.")
        )
        self.record_bytes = BatchedCounter(
            Counter("llm_gateway_request_record_bytes", "Bytes written to the record sink.")
        )
        self.record_failures = Counter(
            "llm_gateway_request_record_failures",
            "Record shipping attempts that failed, by kind: redis, sink "
            "(retried), lost (Redis refused a record and the ingress' own buffer was full).",
            ("kind",),
        )
        # An info metric: joins Serve's per-deployment metrics (replicas, autoscaling
        # target) to model names in PromQL (`* on(deployment) group_left(model)`).
        self.model_info = Gauge(
            "llm_gateway_model_info", "1 per served model: its Serve deployment.", ("model", "deployment")
        )
        if self.per_key:
            self.key_requests = BatchedCounter(
                Counter(
                    "llm_gateway_key_requests", "Requests by API key name (bounded: KeyLabels).", ("key_name", "status")
                )
            )
            self.key_tokens = BatchedCounter(
                Counter("llm_gateway_key_tokens", "Tokens by API key name (bounded: KeyLabels).", ("key_name", "kind"))
            )
            self.key_budget = Gauge(
                "llm_gateway_key_budget_used_ratio",
                "Share of a key's token budget used this period, reservations included (named keys only).",
                ("key_name", "period"),
            )
        for operation in REDIS_OPERATIONS:
            zero(self.redis_errors, {"operation": operation})
        for kind in FALLBACK_KINDS:
            zero(self.fallbacks, {"kind": kind})
        zero(self.records_written, {})
        zero(self.record_bytes, {})
        for kind in ("redis", "sink", "lost"):
            zero(self.record_failures, {"kind": kind})
        self._in_flight: dict[str, int] = {}
        self._deployments: dict[str, str] = {}
        self._budgets: dict[tuple[str, str], tuple[float, float]] = {}  # (key, period) -> (ratio, set at)
        self._refresher: asyncio.Task | None = None
        self._flusher: asyncio.Task | None = None

    # -- gauges ------------------------------------------------------------------

    def flush_counters(self) -> None:
        """Record what the batched counters summed since the last flush, and the
        in-flight gauges as they stand."""
        for counter in vars(self).values():
            if isinstance(counter, BatchedCounter):
                counter.flush()
        for model, count in self._in_flight.items():
            self.in_flight.set(count, tags={"model": model})

    async def _flush_counters(self) -> None:
        while True:
            await asyncio.sleep(COUNTER_FLUSH_S)
            self.flush_counters()

    def keep_gauges_fresh(self) -> None:
        """Ray drops a gauge that is not set again within two metrics export
        intervals (its metrics agent's TTL for dead workers' series), so a value
        set once — the model info, an idle in-flight count, a quiet key's
        budget use — would vanish from Prometheus. Re-set them on the running
        loop every half interval (the in-flight counts with the counters' flush,
        every second); cheap wake-ups, not per request."""
        if self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_gauges())
            self._flusher = asyncio.get_running_loop().create_task(self._flush_counters())

    async def _refresh_gauges(self) -> None:
        interval = _gauge_refresh_s()
        while True:
            await asyncio.sleep(interval)
            for model, deployment in self._deployments.items():
                self.model_info.set(1, tags={"model": model, "deployment": deployment})
            cutoff = time.monotonic() - BUDGET_SERIES_KEEP_S
            for (key_name, period), (ratio, at) in list(self._budgets.items()):
                if at < cutoff:
                    del self._budgets[key_name, period]  # Ray's TTL then removes the series
                else:
                    self.key_budget.set(ratio, tags={"key_name": key_name, "period": period})

    def models_served(self, deployments: dict[str, str]) -> None:
        """``deployments``: model name -> its Serve deployment name."""
        self._deployments = dict(deployments)
        for model, deployment in deployments.items():
            self.model_info.set(1, tags={"model": model, "deployment": deployment})
            for counter in (
                self.prompt_tokens,
                self.completion_tokens,
                self.disconnects,
                self.prompt_resizes,
                self.stalled_streams,
                self.ejections,
            ):
                zero(counter, {"model": model})
            for reason in RETRY_REASONS:
                zero(self.retries, {"model": model, "reason": reason})
            for outcome in EARLY_OUTCOMES:
                zero(self.early_starts, {"model": model, "outcome": outcome})
            for limit in sorted(set(LIMIT_KINDS.values())):
                for level in REFUSAL_LEVELS:
                    zero(self.refusals, {"model": model, "limit": limit, "level": level})

    # -- events ------------------------------------------------------------------

    def admitted(self, record: RequestRecord) -> None:
        record.admitted_at = time.monotonic()
        self._move_in_flight(record.model, +1)
        record.in_flight = True

    def admission_took(self, seconds: float) -> None:
        self.admission.observe(seconds)

    def budget_used(self, key_name: str, period: str, used: int, budget: int) -> None:
        """A budgeted key's use after an admission decision (per-key metrics, named keys
        only: a ratio summed over '(other keys)' would mean nothing)."""
        if self.per_key and budget > 0 and self.key_labels.label(key_name) == key_name:
            self.key_budget.set(used / budget, tags={"key_name": key_name, "period": period})
            self._budgets[key_name, period] = (used / budget, time.monotonic())

    def team_charged(
        self, team_name: str, prompt: int, completion: int, reserved: int, cost_nanos: int, cached_prompt: int = 0
    ) -> None:
        """A request of a team's key settled: the tokens charged (``reserved`` when its
        usage never came), what they cost, and how much of its prompt was cached."""
        team = self.team_labels.label(team_name)
        for kind, count in (("prompt", prompt), ("completion", completion), ("reserved", reserved)):
            if count > 0:
                self.team_tokens.inc(count, tags={"team": team, "kind": kind})
        if cached_prompt > 0:
            self.team_cached_tokens.inc(cached_prompt, tags={"team": team})
        if cost_nanos > 0:
            self.team_spend.inc(cost_nanos / 1e9, tags={"team": team})

    def team_refused(self, team_name: str, level: str) -> None:
        self.team_refusals.inc(tags={"team": self.team_labels.label(team_name), "level": level})

    def redis_failed(self, operation: str) -> None:
        self.redis_errors.inc(tags={"operation": operation})

    def records_backlog(self, waiting: int) -> None:
        self.record_backlog.set(waiting)

    def records_shipped(self, count: int, written_bytes: int) -> None:
        self.records_written.inc(count)
        self.record_bytes.inc(written_bytes)

    def records_ship_failed(self, kind: str) -> None:
        self.record_failures.inc(tags={"kind": kind})

    def fell_back(self, kind: str) -> None:
        self.fallbacks.inc(tags={"kind": kind})

    def finish(self, record: RequestRecord) -> None:
        """The request is over (answered, refused, failed or cancelled)."""
        now = time.monotonic()
        model = record.model or "unknown"
        if record.in_flight:
            self._move_in_flight(record.model, -1)
            record.in_flight = False
        status = str(record.status)
        self.requests.inc(tags={"model": model, "route": record.route, "status": status})
        self.answered_counts[record.route] += 1
        self.duration.observe(now - record.started, tags={"model": model, "route": record.route})
        if record.limit:
            self.refusals.inc(tags={"model": model, "limit": record.limit, "level": record.level})
        if record.prompt_tokens:
            self.prompt_tokens.inc(record.prompt_tokens, tags={"model": model})
        if record.completion_tokens:
            self.completion_tokens.inc(record.completion_tokens, tags={"model": model})
        if record.first_token_at is not None:
            self.ttft.observe(record.first_token_at - record.started, tags={"model": model})
            if record.completion_tokens > 1 and not record.cancelled:
                per_token = (now - record.first_token_at) / (record.completion_tokens - 1)
                self.tpot.observe(per_token, tags={"model": model})
        if record.cancelled:
            self.disconnects.inc(tags={"model": model})
        if self.per_key and record.key_name:
            key_name = self.key_labels.label(record.key_name)
            self.key_requests.inc(tags={"key_name": key_name, "status": status})
            for kind, count in (("prompt", record.prompt_tokens), ("completion", record.completion_tokens)):
                if count:
                    self.key_tokens.inc(count, tags={"key_name": key_name, "kind": kind})
        if self.access_log is not None:
            self.access_log.info(access_line(record, now))
        if record.trace is not None:
            record.trace.end(record)

    def started_early(self, model: str, outcome: str) -> None:
        """A stream sent before its admission was ``admitted`` or ``withdrawn``."""
        self.early_starts.inc(tags={"model": model, "outcome": outcome})
        self.early_counts[outcome] += 1

    def refused_unread(self, limit: str) -> None:
        """A request refused by ``limit`` before its body was read."""
        self.refused_before_body.inc(tags={"limit": limit})
        self.refused_before_body_count += 1

    def prompt_resized(self, model: str) -> None:
        """A request of ``model`` is admitted again at its prompt's real size."""
        self.prompt_resizes.inc(tags={"model": model})
        self.resize_count += 1

    def retried(self, model: str, reason: str) -> None:
        """A request of ``model`` is sent again to another replica (``reason``: RETRY_REASONS)."""
        self.retries.inc(tags={"model": model, "reason": reason})
        self.failover_counts["retried"] += 1

    def stream_stalled(self, model: str) -> None:
        self.stalled_streams.inc(tags={"model": model})
        self.failover_counts["stalled"] += 1

    def replica_ejected(self, model: str) -> None:
        self.ejections.inc(tags={"model": model})
        self.failover_counts["ejected"] += 1

    def answered_by_fallback(self, model: str, fallback: str) -> None:
        self.model_fallbacks.inc(tags={"model": model, "fallback": fallback})
        self.failover_counts["fell_back"] += 1

    def in_flight_count(self, model: str) -> int:
        """Requests of ``model`` admitted here and not finished."""
        return self._in_flight.get(model, 0)

    def _move_in_flight(self, model: str, delta: int) -> None:
        self._in_flight[model] = self._in_flight.get(model, 0) + delta  # the gauge: at the next flush


def _gauge_refresh_s() -> float:
    """Half of Ray's metrics export interval (its gauge TTL is two intervals)."""
    try:
        return max(metrics_report_interval_s() / 2, 0.5)
    except Exception:  # noqa: BLE001 - not in a Ray worker: Ray's default interval is 10 s
        return 5.0


def access_line(record: RequestRecord, now: float) -> str:
    """One JSON object per request: who, what, how it ended, how long; no text."""
    line = {
        "ts": round(time.time(), 3),
        "request_id": record.request_id,
        "key_id": record.key_id or None,
        "model": record.model or None,
        "route": record.route,
        "operation": record.operation or None,
        "stream": record.stream,
        "status": record.status,
        "latency_ms": round((now - record.started) * 1000, 1),
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
    }
    if record.admitted_at is not None:  # reading, checking and admitting it (Redis' round trip)
        line["admitted_ms"] = round((record.admitted_at - record.started) * 1000, 1)
    if record.first_token_at is not None:
        line["ttft_ms"] = round((record.first_token_at - record.started) * 1000, 1)
    if record.error_code:
        line["error_code"] = record.error_code
    if record.limit:
        line["limit"] = record.limit
    if record.retry_after is not None:
        line["retry_after"] = record.retry_after
    if record.cancelled:
        line["cancelled"] = True
    return json.dumps(line, separators=(",", ":"))


def _access_logger() -> logging.Logger:
    """Access lines on the replica process's stdout, one JSON object each,
    nothing around them (Ray keeps them in the replica's worker-*.out log file,
    where log shippers pick them up). The process's own stdout: Ray Serve
    replaces ``sys.stdout`` with a (buffered) writer into its own log format."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.__stdout__)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # not again through Serve's own formatter
    return logger
