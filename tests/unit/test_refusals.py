"""Pure logic: what a 429 says and carries."""

from serve_app.pipeline.refusals import render
from serve_app.quota.admission import Decision, Refusal, duration
from serve_app.quota.keys import KeyRecord

KEY = KeyRecord(id="k1", name="team-a", created_at=0, requests_per_minute=60, tokens_per_minute=1000,
                max_concurrent=2, daily_token_budget=500)


def refuse(kind, **fields):
    decision = Decision(False, kind, fields.get("retry_ms", 1500), fields.get("rr", 0), 1000,
                        fields.get("kr", 100), 2000, fields.get("detail", ""))
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
