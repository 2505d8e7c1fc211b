"""Quotas tried as a hostile tenant and a failing Redis would: real Redis, Ray
Serve, the vLLM CPU engine, httpx and the openai SDK as clients.

Every test asserts on what was generated and charged (usage the clients saw,
Redis' own counters and records) and on what was left behind (leases, records
not final), not only on status codes. The stack: stack_args.py (one ingress
replica, autoscaled; a 1 s lease; fail_mode open)."""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from ports import free_port
from settled import assert_within_reservations, records, wait_until_settled
from stack import create_key

from direct_route_stack.stack_args import LEASE_S, MODEL
from serve_app.redis_store import redis_names

pytestmark = pytest.mark.e2e

HELLO = [{"role": "user", "content": "Tell me about the license."}]


def post(base_url, secret, path, body, **headers) -> httpx.Response:
    return httpx.post(base_url + path, json=body, timeout=120, headers={"authorization": f"Bearer {secret}", **headers})


def today() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")


def charged(redis, key_id) -> int:
    return int(redis.hget(redis_names.usage(key_id), f"d:{today()}:tokens") or 0)


# -- bad generation sizes ----------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": "1000"}, "max_tokens"),
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 1000.0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "n": "4"}, "n"),
        ("/v1/chat/completions", {"messages": HELLO, "max_completion_tokens": True}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**30}, "max_tokens"),
        ("/invocations", {"model": MODEL, "inputs": "x", "parameters": {"max_new_tokens": "500"}}, "max_tokens"),
        (
            "/serving-endpoints/tiny-llama/invocations",
            {"prompt": "x", "use_raw_prompt": True, "error_behavior": "truncate", "max_tokens": "9"},
            "max_tokens",
        ),
    ],
)
def test_generation_sizes_must_be_real_integers(base_url, redis_server, redis, path, body, param):
    key_id, secret = create_key(redis_server.url, f"sizes-{free_port()}", max_concurrent=1)
    response = post(base_url, secret, path, {"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"], error
    assert redis.zcard(redis_names.concurrency(key_id)) == 0 and records(redis, key_id) == []
    assert (
        post(base_url, secret, "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 1}).status_code
        == 200
    )


# -- 16 hostile clients against a small TPM and daily budget -------------------------------

TPM, DAILY = 2000, 3000

# Shapes that generate more than they used to reserve: list prompts, n > 1, no
# max_tokens (ignore_eos keeps generating), dialect batch inputs, cancelled streams.
SHAPES = {
    "chat without max_tokens": ("/v1/chat/completions", {"messages": HELLO, "ignore_eos": True}),
    "chat n=4": ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 100, "n": 4, "ignore_eos": True}),
    "completions 4 prompts": (
        "/v1/completions",
        {"prompt": ["a", "b", "c", "d"], "max_tokens": 60, "ignore_eos": True},
    ),
    "completions 8 prompts x 500": ("/v1/completions", {"prompt": ["a"] * 8, "max_tokens": 500, "ignore_eos": True}),
    "completions token ids n=2": (
        "/v1/completions",
        {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 40, "n": 2, "ignore_eos": True},
    ),
    "lmi batch": (
        "/invocations",
        {"inputs": ["a", "b", "c"], "parameters": {"max_new_tokens": 50, "ignore_eos_token": True}},
    ),
    "databricks raw list": (
        "/serving-endpoints/tiny-llama/invocations",
        {"prompt": ["a", "b"], "use_raw_prompt": True, "max_tokens": 80, "ignore_eos": True},
    ),
    "huge max_tokens": ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 2**31 - 1, "ignore_eos": True}),
    "stream then cancel": (
        "/v1/chat/completions",
        {"messages": HELLO, "max_tokens": 300, "ignore_eos": True, "stream": True},
    ),
}


def test_hostile_shapes_never_get_more_than_the_allowance(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "hostile", tokens_per_minute=TPM, daily_token_budget=DAILY)
    seen = {"completion": 0, "total": 0}
    statuses: dict[str, list[int]] = {name: [] for name in SHAPES}
    lock = threading.Lock()
    start = time.monotonic()
    duration_s = 12.0  # 16 clients reach the tokens/min limit within seconds; longer only repeats it

    def one(name):
        path, body = SHAPES[name]
        headers = {"authorization": f"Bearer {secret}"}
        if body.get("stream"):
            with httpx.stream(
                "POST", base_url + path, json={"model": MODEL, **body}, headers=headers, timeout=120
            ) as r:
                if r.status_code == 200:
                    for i, _ in enumerate(r.iter_lines()):
                        if i > 5:
                            break  # hang up mid-stream: its reservation stays charged
                else:
                    r.read()
                return r.status_code, None
        response = httpx.post(base_url + path, json={"model": MODEL, **body}, headers=headers, timeout=120)
        usage = response.json().get("usage") if response.status_code == 200 and path.startswith("/v1") else None
        return response.status_code, usage

    def client(index):
        names = sorted(SHAPES)
        i = index
        while time.monotonic() - start < duration_s:
            name = names[i % len(names)]
            i += 1
            status, usage = one(name)
            assert status in (200, 429), (name, status)
            with lock:
                statuses[name].append(status)
                if usage:
                    seen["completion"] += usage["completion_tokens"]
                    seen["total"] += usage["total_tokens"]
            if status == 429:
                time.sleep(0.2)

    with ThreadPoolExecutor(16) as pool:
        for future in [pool.submit(client, i) for i in range(16)]:
            future.result()
    elapsed = time.monotonic() - start
    found = wait_until_settled(redis, key_id)
    assert_within_reservations(found)  # each request, not only their sum

    total_charged = charged(redis, key_id)
    allowance = min(DAILY, TPM + TPM * elapsed / 60)
    assert 0 < total_charged <= allowance, (total_charged, allowance, statuses)
    assert seen["total"] <= total_charged, seen  # clients saw no more than Redis charged
    assert sum(int(r.get("total_tokens", 0)) for r in found) == total_charged
    # `abandoned` too: a replica whose event loop 16 clients and its engine kept busy
    # past the 1 s lease (a CI run) is reaped, charged its reservation, which the
    # allowance above still bounds; what must never be is a record left open.
    assert all(r["status"] in ("completed", "cancelled", "failed", "abandoned") for r in found), Counter(
        r["status"] for r in found
    )
    assert statuses["completions 8 prompts x 500"] and set(statuses["completions 8 prompts x 500"]) == {429}
    assert sum(s == 200 for ss in statuses.values() for s in ss) >= 2


# -- leases, streams and cancellation ---------------------------------------------------------


CHECKED_LEASES = 4  # lease periods a stream is seen to hold its slot (reading all of it: 28 s)


def test_a_stream_outliving_the_lease_keeps_its_slot(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "one-long-stream", max_concurrent=1)
    # As long as the model's context allows; 20 logprobs per token make every step and
    # every relayed chunk heavier (a CI run decoded 2,000 plain tokens in 2.7 s).
    body = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 20,
    }
    checks = []
    with httpx.stream(
        "POST", base_url + "/v1/chat/completions", json=body, timeout=120, headers={"authorization": f"Bearer {secret}"}
    ) as stream:
        assert stream.status_code == 200
        started = time.monotonic()
        for _ in stream.iter_lines():
            # Just past the lease (renewed every third of it), then once per lease period.
            if time.monotonic() - started > LEASE_S * (len(checks) + 1) + 0.25:
                second = post(
                    base_url, secret, "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 1}
                )
                if second.status_code == 200 and _finished(redis, key_id, stream.headers["x-request-id"]):
                    break  # the gateway had sent it all (it outran this reader, a CI run saw it): slot due back
                checks.append((round(time.monotonic() - started, 1), second.status_code))
                assert second.status_code == 429, f"the running stream lost its slot: {checks}"
                assert second.json()["error"]["type"] == "concurrency"
                if len(checks) == CHECKED_LEASES:
                    break  # held past that many leases; hanging up ends it and frees its slot
        elapsed = time.monotonic() - started
    assert checks, f"the stream took {elapsed:.1f}s, not longer than its {LEASE_S}s lease"
    wait_until_settled(redis, key_id)
    assert (
        post(base_url, secret, "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 1}).status_code
        == 200
    )


def _finished(redis, key_id: str, http_request_id: str) -> bool:
    """Whether that request's record is final (settling frees its slot in the same script)."""
    return any(
        record.get("http_request_id") == http_request_id and record["status"] not in ("admitted", "running")
        for record in records(redis, key_id)
    )


def test_a_mix_of_limits_reports_the_longest_wait(base_url, redis_server):
    # One request/min and one at a time, a stream running: concurrency (1 s hint)
    # and requests/min (a minute) both refuse; retry-after must be the minute.
    _, secret = create_key(redis_server.url, "mixed-limits", requests_per_minute=1, max_concurrent=1)
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", base_url + "/v1/chat/completions", json=body, timeout=120, headers={"authorization": f"Bearer {secret}"}
    ) as stream:
        assert stream.status_code == 200
        client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0)
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    assert caught.value.body["type"] == "requests"
    assert 58 <= int(caught.value.response.headers["retry-after"]) <= 60


# -- Redis footprint of refusals -----------------------------------------------------------------


# Enough that anything kept per refusal shows (a key or a record is tens of bytes; 3 bytes
# each pass the 1 KB bound below), few enough to spare the suite's time (1,000: 47 s here).
REFUSALS = 400


def test_hundreds_of_refusals_with_4kb_request_ids_store_almost_nothing(base_url, redis_server, redis):
    # A budget that one request nearly uses up refuses the rest for the day (a
    # requests/min limit would refill during the run and admit some).
    key_id, secret = create_key(redis_server.url, "refused-a-lot", daily_token_budget=200)
    first = {"model": MODEL, "messages": HELLO, "max_tokens": 100, "ignore_eos": True}
    assert post(base_url, secret, "/v1/chat/completions", first).status_code == 200
    wait_until_settled(redis, key_id)
    assert charged(redis, key_id) > 100

    def refused(i):
        request_id = f"{i:04d}" + "x" * 4092
        response = post(
            base_url,
            secret,
            "/v1/chat/completions",
            {"model": MODEL, "messages": HELLO, "max_tokens": 90},
            **{"x-request-id": request_id},
        )
        return response.status_code

    def stored() -> int:
        """Bytes of every key in Redis (MEMORY USAGE): what is kept, without the
        connection buffers that make INFO's used_memory swing by hundreds of KB."""
        return sum(redis.memory_usage(name, samples=0) or 0 for name in redis.scan_iter(count=1000))

    with ThreadPoolExecutor(16) as pool:
        assert set(pool.map(refused, range(40))) == {429}  # its counters exist before the count
        before, used_before, keys_before = (
            stored(),
            redis.info("memory")["used_memory"],
            set(redis.scan_iter(count=1000)),
        )
        assert set(pool.map(refused, range(REFUSALS))) == {429}
    grown, used_grown = stored() - before, redis.info("memory")["used_memory"] - used_before
    # Counters only: no key per refusal, a few bytes of counters in all. Keys may come and
    # go meanwhile that no request makes (the batch reconciler's lock lives one period).
    new_keys = {name.decode() for name in set(redis.scan_iter(count=1000)) - keys_before}
    assert not {name for name in new_keys if name != redis_names.BATCH_RECONCILER}, new_keys
    assert grown < 1024, grown
    assert used_grown < 1024 * 1024, used_grown  # before: ~9.5 MB for 1,000 refusals (3.8 MB for these)
    print(f"\n{REFUSALS} refusals: stored keys grew by {grown} bytes, used_memory by {used_grown}")


# -- a stalled Redis (SIGSTOP) ------------------------------------------------------------------------


def test_a_stalled_redis_leaves_no_lease_and_no_double_charge(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, "stalled", max_concurrent=1, daily_token_budget=100_000)
    request = {"model": MODEL, "messages": HELLO, "max_tokens": 8, "ignore_eos": True}
    first = post(base_url, secret, "/v1/chat/completions", request)  # caches the key in the ingress
    assert first.status_code == 200
    wait_until_settled(redis, key_id)
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        during = [post(base_url, secret, "/v1/chat/completions", request) for _ in range(3)]
    finally:
        time.sleep(1)
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert [r.status_code for r in during] == [200, 200, 200], [r.text for r in during]
    found = wait_until_settled(redis, key_id, timeout_s=20, records_expected=4)
    used = [first.json()["usage"]["total_tokens"]] + [r.json()["usage"]["total_tokens"] for r in during]
    ids = {first.json()["id"].removeprefix("chatcmpl-")} | {r.json()["id"].removeprefix("chatcmpl-") for r in during}
    settled = [r for r in found if r.get("total_tokens")]
    assert charged(redis, key_id) == sum(used), (charged(redis, key_id), used, found)  # each request once
    assert len(settled) == 4 and all(r["status"] == "completed" for r in settled), found
    assert {r["key_id"] for r in found} == {key_id} and len(ids) == 4
    after = post(base_url, secret, "/v1/chat/completions", request)
    assert after.status_code == 200  # no leaked slot for the concurrency-limited key


def test_fail_open_share_follows_the_running_ingress_count(base_url, redis_server, redis):
    # One running ingress replica (autoscaled, max 4): during an outage it enforces
    # the whole limit, not limit / max.
    key_id, secret = create_key(redis_server.url, "outage-share", requests_per_minute=4)
    request = {"model": MODEL, "messages": HELLO, "max_tokens": 1}
    assert post(base_url, secret, "/v1/chat/completions", request).status_code == 200  # cached
    wait_until_settled(redis, key_id)
    redis.delete(redis_names.requests_rate(key_id))  # the local limiter starts from a full burst too
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        statuses = [post(base_url, secret, "/v1/chat/completions", request).status_code for _ in range(6)]
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert statuses == [200] * 4 + [429] * 2, statuses
    wait_until_settled(redis, key_id, timeout_s=20)
