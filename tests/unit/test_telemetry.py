"""Pure logic: what one request leaves in the access log (no text, the fields
an operator needs) and how a refusal is classified for metrics."""

import json

from contract.replica_wire import Usage
from serve_app.telemetry import (
    OTHER_KEYS,
    OTHER_TEAMS,
    BatchedCounter,
    KeyLabels,
    RequestRecord,
    Telemetry,
    access_line,
    zero,
)


def test_access_line_is_one_json_object_with_the_request_outcome():
    record = RequestRecord("openai", request_id="req-1", started=100.0)
    record.key_id, record.key_name, record.model, record.operation = "k1", "team-a", "tiny-llama", "chat"
    record.stream, record.status, record.admitted_at, record.first_token_at = True, 200, 100.002, 100.05
    record.used(Usage(prompt_tokens=12, completion_tokens=30))
    line = access_line(record, now=100.5)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["request_id"] == "req-1" and entry["key_id"] == "k1" and entry["model"] == "tiny-llama"
    assert (entry["status"], entry["prompt_tokens"], entry["completion_tokens"]) == (200, 12, 30)
    assert entry["latency_ms"] == 500.0 and entry["ttft_ms"] == 50.0 and entry["stream"] is True
    assert entry["admitted_ms"] == 2.0  # the quota decision's part of the time to first token
    assert "key_name" not in entry and "retry_after" not in entry  # key names stay out of logs by default


def test_refusals_carry_the_limit_kind_and_retry_after():
    record = RequestRecord("azure")
    record.refused(429, "insufficient_quota", "daily_token_budget", {"retry-after": "3600"})
    entry = json.loads(access_line(record, now=record.started))
    assert (entry["status"], entry["limit"], entry["retry_after"], entry["error_code"]) == (
        429,
        "budget",
        "3600",
        "insufficient_quota",
    )
    for error_type, limit in [("requests", "requests"), ("tokens", "tokens"), ("concurrency", "concurrency")]:
        record = RequestRecord("openai")
        record.refused(429, "rate_limit_exceeded", error_type, {"retry-after": "1"})
        assert record.limit == limit
    for error_type in ("daily_cost_budget", "monthly_cost_budget", "monthly_token_budget"):
        record = RequestRecord("openai")
        record.refused(429, "insufficient_quota", error_type, {"retry-after": "60"})
        assert record.limit == "budget"
    # The level that refused, from the 429's scope header: the key's own unless it says team.
    assert record.level == "key"
    team = RequestRecord("openai")
    team.refused(429, "rate_limit_exceeded", "requests", {"retry-after": "1", "x-ratelimit-scope": "team"})
    assert (team.limit, team.level) == ("requests", "team")
    overloaded = RequestRecord("openai")
    overloaded.refused(503, "model_overloaded", "service_unavailable_error", {"retry-after": "1"})
    assert overloaded.limit is None and overloaded.retry_after == "1"  # 503 is the cluster, not a quota


def test_no_prompt_or_completion_text_can_reach_the_line():
    fields = set(json.loads(access_line(RequestRecord("openai"), now=0)))
    assert not fields & {"messages", "prompt", "content", "input", "text", "choices"}


def test_per_key_metrics_are_on_and_bounded_by_default():
    from serve_app.settings import AppSettings

    telemetry = AppSettings().telemetry
    assert telemetry.per_key_metrics is True and telemetry.per_key_max_keys == 100


def test_key_labels_name_the_first_keys_and_pool_the_rest():
    labels = KeyLabels(limit=3)
    assert [labels.label(name) for name in ("a", "b", "a", "c")] == ["a", "b", "a", "c"]
    minted = {labels.label(f"minted-{n}") for n in range(10_000)}  # a tenant minting keys
    assert minted == {OTHER_KEYS}
    assert [labels.label(name) for name in ("c", "b", "a")] == ["c", "b", "a"]  # the named keep their series


def test_team_labels_are_bounded_under_their_own_name():
    labels = KeyLabels(limit=2, other=OTHER_TEAMS)
    assert [labels.label(name) for name in ("ml", "search", "ads", "ml")] == ["ml", "search", OTHER_TEAMS, "ml"]


def test_a_counter_can_be_exported_at_zero():
    """``zero`` reaches past Ray's ``Counter.inc`` (which refuses 0) to the recording
    path it calls: pinned here, so a Ray upgrade that changes it fails a unit test,
    not a dashboard."""
    import inspect

    from ray.util.metrics import Counter

    from serve_app.telemetry import zero

    assert "value" in inspect.signature(Counter._record).parameters
    counter = Counter("llm_gateway_unit_zero", "test", ("model",))
    zero(counter, {"model": "m"})  # no error, outside a Ray worker too
    try:
        counter.inc(0, tags={"model": "m"})
    except ValueError:
        pass  # still refused by inc: the reason zero() exists
    else:
        raise AssertionError("Counter.inc accepts 0 now: use it in zero()")


class _RecordingCounter:
    def __init__(self):
        self.records: list[tuple[float, dict]] = []

    def inc(self, value=1.0, tags=None):
        self.records.append((value, tags))

    def _record(self, value, tags=None):
        self.records.append((value, tags))


def test_a_batched_counter_records_each_series_once_per_flush_with_the_sum():
    """Per-request counters cost one Ray record per series and flush, not one per
    request (issue 57); nothing is lost, and a zero export is not held back."""
    ray_counter = _RecordingCounter()
    counter = BatchedCounter(ray_counter)
    zero(counter, {"model": "m"})
    assert ray_counter.records == [(0, {"model": "m"})]
    for _ in range(50):
        counter.inc(tags={"model": "m", "status": "200"})
        counter.inc(3, tags={"model": "n", "status": "200"})
    counter.inc(0, tags={"model": "quiet", "status": "200"})
    assert len(ray_counter.records) == 1  # nothing recorded before the flush
    counter.flush()
    assert ray_counter.records[1:] == [
        (50.0, {"model": "m", "status": "200"}),
        (150.0, {"model": "n", "status": "200"}),
    ]
    counter.flush()
    assert len(ray_counter.records) == 3  # nothing new: nothing recorded


def test_the_per_request_counters_of_the_gateway_are_batched():
    telemetry = Telemetry(per_key_metrics=True, access_log=False)
    batched = {name for name, value in vars(telemetry).items() if isinstance(value, BatchedCounter)}
    assert {"requests", "prompt_tokens", "completion_tokens", "key_requests", "key_tokens", "team_tokens"} <= batched


def test_an_identity_tokens_user_has_its_own_per_key_series_under_its_name():
    from serve_app.identity.jwt_auth import JwtAuthenticator
    from serve_app.settings import JwtConfig

    config = JwtConfig(issuer="https://idp.example.com/", audience="llm-gateway", jwks_url="https://idp.example.com/k")
    user = JwtAuthenticator(config)._record({"sub": "ana@example.com"})
    telemetry = Telemetry(per_key_metrics=True, access_log=False)
    record = RequestRecord("openai", request_id="req-1", started=100.0)
    record.for_key(user)
    record.model, record.status, record.prompt_tokens, record.completion_tokens = "tiny-llama", 200, 7, 3
    telemetry.finish(record)
    assert telemetry.key_requests._pending == {(("key_name", "jwt:ana@example.com"), ("status", "200")): 1.0}
    assert telemetry.key_tokens._pending == {
        (("key_name", "jwt:ana@example.com"), ("kind", "prompt")): 7.0,
        (("key_name", "jwt:ana@example.com"), ("kind", "completion")): 3.0,
    }
