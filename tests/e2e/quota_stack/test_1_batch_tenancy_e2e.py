"""A batch holds the key's promises as the key is *now*, against a hostile or
careless tenant, on the stack with two ingress replicas: a revoked key's batch
stops within seconds, lowered limits apply to its next request, a batch that
cannot proceed is parked and holds no runner's place, a cancel stops it within
the requests in flight, and an admin lists and cancels any key's batch (admin API
and ``llmctl``). Asserted on what ran and what was charged (request records in
Redis, the result files on disk), not only on statuses."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from settled import inference, records, wait_until_settled
from stack import BIN, create_key

from quota_stack.stack_args import ADMIN, FILES_DIR
from quota_stack.test_1_batches_e2e import ENDED, chat_line, ended, sdk, start, wait_for
from serve_app.redis_store import redis_names

pytestmark = pytest.mark.e2e

CONCURRENCY = 4  # batch.concurrency: a batch's requests in flight at once
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}


def admin_batch(base_url: str, key_id: str, batch_id: str) -> dict:
    """The batch as the admin API shows it (its key may no longer authenticate)."""
    page = httpx.get(
        base_url + "/admin/batches", params={"key": key_id, "limit": 100}, headers=ADMIN_HEADERS, timeout=30
    ).json()
    [batch] = [b for b in page["data"] if b["id"] == batch_id]
    return batch


def wait_for_admin(base_url: str, key_id: str, batch_id: str, until, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while not until(batch := admin_batch(base_url, key_id, batch_id)):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def file_lines(key_id: str, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in Path(FILES_DIR, key_id, file_id).read_text().splitlines()]


def completed_records(redis, key_id: str) -> int:
    return sum(r["status"] == "completed" for r in inference(records(redis, key_id)))


def test_a_revoked_keys_batch_stops_within_seconds(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "tenancy-revoked")
    client = sdk(base_url, secret)
    lines = [chat_line(f"r-{i}", max_tokens=8) for i in range(120)]
    batch = start(client, lines)
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 4)
    assert httpx.delete(base_url + f"/admin/keys/{key_id}", headers=ADMIN_HEADERS, timeout=30).status_code == 200
    revoked_at = time.monotonic()
    ran_at_revocation = completed_records(redis, key_id)
    stopped = wait_for_admin(
        base_url, key_id, batch.id, lambda b: b["status"] in ("cancelled", "completed"), timeout_s=10
    )
    assert time.monotonic() - revoked_at < 10 and stopped["status"] == "cancelled", stopped
    # Nothing more runs: what ran after the revocation is what was in flight then
    # (the key is read before each request is sent).
    wait_until_settled(redis, key_id)
    time.sleep(2)
    ran = completed_records(redis, key_id)
    assert ran <= ran_at_revocation + CONCURRENCY, (ran_at_revocation, ran)
    output, errors = file_lines(key_id, stopped.get("output_file_id")), file_lines(key_id, stopped["error_file_id"])
    assert len(output) == ran and len(output) + len(errors) == 120
    # A line not yet sent is answered `api_key_revoked`; one in flight at the
    # revocation was cut there (its call cancelled) and answers the 401 it got.
    cut = [line for line in errors if line["error"] is None]
    assert {line["error"]["code"] for line in errors if line["error"]} == {"api_key_revoked"}
    assert len(cut) <= CONCURRENCY and all(
        line["response"]["status_code"] == 401 and line["response"]["body"]["error"]["code"] == "invalid_api_key"
        for line in cut
    ), cut
    assert redis.zcard(redis_names.concurrency(key_id)) == 0
    # The revocation is in the audit trail: who, and what it changed.
    trail = httpx.get(base_url + "/admin/audit", params={"target": key_id}, headers=ADMIN_HEADERS, timeout=30).json()
    [revoked] = [entry for entry in trail["data"] if entry["action"] == "key.revoke"]
    assert revoked["actor"] == "admin-token" and (revoked["before"], revoked["after"]) == (
        {"enabled": True},
        {"enabled": False},
    )


def test_limits_lowered_mid_batch_apply_to_its_next_request_and_a_cancel_ends_it_while_parked(
    base_url, redis_server, redis
):
    key_id, secret = create_key(redis_server.url, "tenancy-lowered")
    client = sdk(base_url, secret)
    lines = [chat_line(f"l-{i}", max_tokens=16, min_tokens=16, ignore_eos=True) for i in range(60)]
    batch = start(client, lines)
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 4)
    usage_key = redis_names.usage(key_id)
    today = time.strftime("d:%Y%m%d", time.gmtime())
    spent = int(redis.hget(usage_key, f"{today}:tokens") or 0)
    budget = spent + 300
    changed = httpx.patch(
        base_url + f"/admin/keys/{key_id}",
        headers=ADMIN_HEADERS,
        timeout=30,
        json={"daily_token_budget": budget, "requests_per_minute": 1},
    )
    assert changed.status_code == 200
    time.sleep(8)  # the key cache (1 s) is long past; the batch has met its new limits
    wait_until_settled(redis, key_id)
    charged = int(redis.hget(usage_key, f"{today}:tokens"))
    # Exact, as for any request: what was counted when the budget was set (the
    # reservations in flight included), and no more than the new budget allows
    # after it; the slack is the requests admitted between reading the counter and
    # the change (a round of the batch, each reserving under 100 tokens).
    assert charged <= budget + CONCURRENCY * 100, (spent, budget, charged)
    # (Read and cancelled through the admin API: the key's own calls count against its 1/min now.)
    parked = admin_batch(base_url, key_id, batch.id)
    assert parked["status"] == "in_progress" and parked["request_counts"]["completed"] < 60
    time.sleep(3)
    assert int(redis.hget(usage_key, f"{today}:tokens")) == charged  # parked: nothing more runs
    # A cancel ends it at once, though it waits for a limit that renews in a minute.
    cancelled_at = time.monotonic()
    assert (
        httpx.post(base_url + f"/admin/batches/{batch.id}/cancel", headers=ADMIN_HEADERS, timeout=30).status_code == 200
    )
    done = wait_for_admin(base_url, key_id, batch.id, lambda b: b["status"] in ENDED, timeout_s=15)
    assert done["status"] == "cancelled" and time.monotonic() - cancelled_at < 15
    assert redis.zcard(redis_names.concurrency(key_id)) == 0
    # Both admin actions are in the audit trail, the limits' change with its old values.
    audit = {
        target: httpx.get(
            base_url + "/admin/audit", params={"target": target}, headers=ADMIN_HEADERS, timeout=30
        ).json()["data"]
        for target in (key_id, batch.id)
    }
    [change] = [entry for entry in audit[key_id] if entry["action"] == "key.update"]
    assert change["after"] == {"daily_token_budget": budget, "requests_per_minute": 1}
    assert set(change["before"]) == {"daily_token_budget", "requests_per_minute"}
    [cancel] = audit[batch.id]
    assert (cancel["action"], cancel["actor"], cancel["after"]["key_id"]) == ("batch.cancel", "admin-token", key_id)


def test_a_batch_that_cannot_proceed_holds_no_place_from_another_keys(base_url, redis_server, redis):
    """Key D's budget is spent by its first requests, and it has as many batches as
    there are ingress replicas; key B's one-request batch still runs at once."""
    d_id, d_secret = create_key(redis_server.url, "tenancy-spent", daily_token_budget=400)
    d = sdk(base_url, d_secret)
    lines = [chat_line(f"d-{i}", max_tokens=32, min_tokens=32, ignore_eos=True) for i in range(12)]
    d_batches = [start(d, lines), start(d, lines)]
    deadline = time.monotonic() + 60
    while int(redis.hget(redis_names.usage(d_id), time.strftime("d:%Y%m%d:tokens", time.gmtime())) or 0) < 200:
        assert time.monotonic() < deadline, "key D never spent its budget"
        time.sleep(0.2)
    _, b_secret = create_key(redis_server.url, "tenancy-other")
    b = sdk(base_url, b_secret)
    started = time.monotonic()
    other = wait_for(b, start(b, [chat_line("b-0")]).id, ended, timeout_s=30)
    assert other.status == "completed" and other.request_counts.completed == 1
    assert time.monotonic() - started < 15  # a runner's poll and one request, not D's 24 h window
    # D's batches ran within its budget and wait, parked, without a runner's place.
    assert {d.batches.retrieve(batch.id).status for batch in d_batches} <= {"validating", "in_progress"}
    spent = inference(wait_until_settled(redis, d_id))
    assert sum(int(r["prompt_tokens"]) + int(r["completion_tokens"]) for r in spent) <= 400
    for batch in d_batches:
        d.batches.cancel(batch.id)
    for batch in d_batches:
        assert wait_for(d, batch.id, ended, timeout_s=15).status == "cancelled"


def test_a_cancel_stops_a_batch_within_the_requests_in_flight(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "tenancy-cancel")
    client = sdk(base_url, secret)
    lines = [chat_line(f"c-{i}", max_tokens=32, min_tokens=32, ignore_eos=True) for i in range(48)]
    batch = start(client, lines)
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 4)
    ran_before = completed_records(redis, key_id) + len(
        [r for r in inference(records(redis, key_id)) if r["status"] in ("admitted", "running")]
    )
    client.batches.cancel(batch.id)
    batch = wait_for(client, batch.id, ended, timeout_s=60)
    assert batch.status == "cancelled"
    wait_until_settled(redis, key_id)
    ran = completed_records(redis, key_id)
    # Those in flight when it was cancelled finish; at most one more round was sent
    # between reading the records and the cancel (the status is read before each send).
    assert ran <= ran_before + CONCURRENCY, (ran_before, ran)
    assert batch.request_counts.completed == ran and batch.request_counts.failed == 48 - ran


def test_an_admin_lists_and_cancels_any_keys_batch_through_the_api_and_llmctl(base_url, redis_server, redis):
    # 40 tokens a minute: a line reserves ~25, so each batch parks after its first one.
    key_id, secret = create_key(redis_server.url, "tenancy-admin", tokens_per_minute=40)
    client = sdk(base_url, secret)
    first = start(client, [chat_line("a-0"), chat_line("a-1"), chat_line("a-2")])
    second = start(client, [chat_line("b-0"), chat_line("b-1")])
    assert httpx.get(base_url + "/admin/batches", timeout=30).status_code == 401
    listed = httpx.get(base_url + "/admin/batches", headers=ADMIN_HEADERS, timeout=30).json()["data"]
    assert {(b["key_id"], b["id"]) for b in listed} >= {(key_id, first.id), (key_id, second.id)}
    env = {"REDIS_URL": redis_server.url, "PATH": str(BIN)}
    shown = subprocess.run(
        [str(BIN / "llmctl"), "batches", "list", "--key", "tenancy-admin"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert [b["id"] for b in json.loads(shown.stdout)] == [second.id, first.id]  # newest first
    cancelled = httpx.post(base_url + f"/admin/batches/{first.id}/cancel", headers=ADMIN_HEADERS, timeout=30)
    assert cancelled.status_code == 200 and cancelled.json()["status"] in ("cancelling", "cancelled")
    by_cli = subprocess.run(
        [str(BIN / "llmctl"), "batches", "cancel", second.id],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(by_cli.stdout)["key_id"] == key_id
    for batch in (first, second):
        assert wait_for(client, batch.id, ended, timeout_s=30).status == "cancelled"
    missing = httpx.post(base_url + f"/admin/batches/{first.id}/cancel", headers=ADMIN_HEADERS, timeout=30)
    assert missing.status_code == 404  # ended: nothing left to stop
    # Each cancel is audited under who made it (the 404 changed nothing: not recorded).
    trail = subprocess.run(
        [str(BIN / "llmctl"), "audit", "--limit", "1000"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    cancels = {e["target"]: e["actor"] for e in json.loads(trail.stdout) if e["action"] == "batch.cancel"}
    assert cancels[first.id] == "admin-token" and cancels[second.id].startswith("llmctl:")
