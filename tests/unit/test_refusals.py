"""Pure logic: what a 429 says and carries."""

from serve_app.admission.seam import Decision, Refusal, duration
from serve_app.identity.keys import KeyRecord
from serve_app.pipeline.refusals import render

KEY = KeyRecord(
    id="k1",
    name="team-a",
    created_at=0,
    requests_per_minute=60,
    tokens_per_minute=1000,
    max_concurrent=2,
    daily_token_budget=500,
)


def refuse(kind, **fields):
    decision = Decision(
        False,
        kind,
        fields.get("retry_ms", 1500),
        fields.get("rr", 0),
        1000,
        fields.get("kr", 100),
        2000,
        fields.get("detail", ""),
    )
    return render(Refusal(KEY, kind, 300, decision))


def test_rate_limit_message_names_limit_usage_and_retry():
    error = refuse("tokens", kr=100)
    assert error.status == 429 and error.type == "tokens" and error.code == "rate_limit_exceeded"
    assert "limit 1000 tokens per minute, used 900, requested 300" in error.message
    assert "try again in 1.5s" in error.message
    assert error.headers["retry-after"] == "2" and error.headers["retry-after-ms"] == "1500"
    assert error.headers["x-ratelimit-remaining-tokens"] == "100"


def test_budget_refusal_is_insufficient_quota():
    error = refuse("daily_budget", detail="450", retry_ms=3_600_000)
    assert error.code == "insufficient_quota" and error.type == "daily_token_budget"
    assert "used 450" in error.message and error.headers["retry-after"] == "3600"


def test_too_large_has_no_retry_after():
    error = refuse("tokens_too_large", retry_ms=-1)
    assert "too large" in error.message.lower() and "retry-after" not in error.headers


def test_reset_durations_read_like_openais():
    assert [duration(ms) for ms in (20, 1500, 60_000, 361_000)] == ["20ms", "1.5s", "1m0s", "6m1s"]


def test_a_local_limits_refusal_says_when_to_retry():
    error = render(Refusal(KEY, "concurrency", 10, retry_s=1.0))
    assert error.status == 429 and error.type == "concurrency" and error.code == "rate_limit_exceeded"
    assert error.headers == {"retry-after": "1", "retry-after-ms": "1000"}


def test_a_money_budget_is_named_with_its_significant_digits():
    for budget, shown in ((0.004, "$0.004"), (0.0005, "$0.0005"), (12.5, "$12.5")):
        key = KEY.model_copy(update={"daily_cost_budget_usd": budget})
        decision = Decision(False, "daily_cost_budget", 60_000, 0, 0, 0, 0, "1000")
        error = render(Refusal(key, "daily_cost_budget", 300, decision, reserved_nanos=2_000))
        assert f"({shown}; spent $0.000001" in error.message, error.message


def test_an_account_disabled_since_it_was_cached_is_a_401_never_a_429():
    decision = Decision(False, "revoked", -1, -1, 0, -1, 0, "")
    key_error = render(Refusal(KEY, "revoked", 300, decision))
    assert key_error.status == 401 and key_error.code == "invalid_api_key" and "retry-after" not in key_error.headers
    team_error = render(Refusal(KEY, "revoked", 300, decision, level="team"))
    assert team_error.status == 401 and team_error.code == "team_disabled"


def test_a_refusal_names_the_limits_redis_applied_not_the_cached_ones():
    decision = Decision(False, "daily_budget", 3_600_000, 5, 1000, 50, 2000, "450", applied="30,400,1,450,0,0,0")
    refused = Refusal(decision.as_applied(KEY), "daily_budget", 300, decision)
    error = render(refused)
    assert "a daily budget of 450 tokens" in error.message
    assert error.headers["x-ratelimit-limit-requests"] == "30" and error.headers["x-ratelimit-limit-tokens"] == "400"
