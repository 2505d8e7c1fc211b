"""The reservation bounds every prompt, on the real stack (two ingress replicas, vLLM's
CPU engine, the demo model's byte-level BPE tokenizer): a hostile tenant's bursts of
token-dense prompts — emoji, CJK, Tamil, punctuation runs, digits, four times and more
denser than the gateway's estimate — against a key's and a team's daily token budget,
a team's money budget and a key's tokens/min are never charged past the limit; every
route that runs a prompt answers such a prompt (the replica refuses it at its estimate,
the gateway admits it again at its real size) and charges exactly what it answered.
Asserted on what Redis charged, not on statuses (docs/quotas.md, "The reservation
bounds every prompt"). And a team over its budget can still stop its work and fetch
what it paid for: nothing that spends no tokens is refused by a budget."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest
from dense_prompts import burst, dense, estimate
from settled import assert_within_reservations, counters, wait_until_settled
from stack import call_replica, create_key, local_app_args

from quota_stack.stack_args import MODEL
from quota_stack.test_1_batches_e2e import chat_line, jsonl, wait_for
from quota_stack.test_1_teams_e2e import admin, prices

pytestmark = pytest.mark.e2e


def cached_price() -> int:
    """The stack's price of a cached prompt token of the model, in nano-dollars."""
    [model] = [m for m in local_app_args([MODEL])["models"] if m["name"] == MODEL]
    return round(model["pricing"]["cached_prompt_per_million"] * 1000)


def cached(usage) -> int:
    details = usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details else 0


def test_a_keys_daily_budget_holds_against_a_burst_of_emoji(base_url, redis_server, redis):
    budget = 5_000
    key_id, secret = create_key(redis_server.url, f"emoji-{time.monotonic_ns()}", daily_token_budget=budget)
    prompt = dense("emoji", 400, seed=1)
    answered = burst(base_url, [secret], [prompt], max_tokens=100, model=MODEL)
    assert_within_reservations(wait_until_settled(redis, key_id))
    charged = counters(redis, key_id)
    assert answered, "the budget holds at least one such request"
    assert all(usage.prompt_tokens > estimate(prompt) for usage in answered)  # denser than estimated
    assert charged["tokens"] == sum(u.prompt_tokens + u.completion_tokens for u in answered)
    assert charged["tokens"] <= budget, (charged, len(answered))


def test_a_teams_token_and_money_budgets_hold_against_both_keys_bursting(base_url, redis):
    tag = time.monotonic_ns()
    budget, usd = 5_000, 0.001
    per_prompt, per_completion = prices()
    per_cached = cached_price()
    for limit, value in (("daily_token_budget", budget), ("daily_cost_budget_usd", usd)):
        team = admin("POST", base_url, "/admin/teams", name=f"dense-{limit}-{tag}", **{limit: value})
        keys = [
            admin("POST", base_url, "/admin/keys", name=f"dense-{limit}-{tag}-{i}", team=team["id"]) for i in range(2)
        ]
        prompts = [dense("emoji", 400, seed=2), dense("cjk", 500, seed=3)]
        answered = burst(base_url, [key["secret"] for key in keys], prompts, max_tokens=100, model=MODEL)
        # Per request record, both keys' (one key may have had all its requests refused).
        assert_within_reservations([record for key in keys for record in wait_until_settled(redis, key["id"])])
        wait_until_settled(redis, team["id"])
        charged = counters(redis, team["id"])
        assert answered
        assert charged["tokens"] == sum(u.prompt_tokens + u.completion_tokens for u in answered)
        assert charged["tokens"] == sum(counters(redis, key["id"]).get("tokens", 0) for key in keys)
        if limit == "daily_token_budget":
            assert charged["tokens"] <= budget, charged
        else:
            assert charged["cost_nanos"] == sum(
                (u.prompt_tokens - cached(u)) * per_prompt
                + cached(u) * per_cached
                + u.completion_tokens * per_completion
                for u in answered
            )
            assert charged["cost_nanos"] <= usd * 1e9, charged


def test_a_keys_tokens_per_minute_holds_against_every_dense_script(base_url, redis_server, redis):
    limit = 4_000
    key_id, secret = create_key(redis_server.url, f"tpm-dense-{time.monotonic_ns()}", tokens_per_minute=limit)
    prompts = [dense(script, 300, seed=i) for i, script in enumerate(["cjk", "tamil", "punctuation", "digits"])]
    started = time.monotonic()
    answered = burst(base_url, [secret], prompts, max_tokens=50, model=MODEL)
    took = time.monotonic() - started
    assert_within_reservations(wait_until_settled(redis, key_id))
    charged = counters(redis, key_id)["tokens"]
    assert answered and charged == sum(u.prompt_tokens + u.completion_tokens for u in answered)
    # What the minute's window lets in: the limit, and what refilled while the burst ran.
    assert charged <= limit * (1 + took / 60), (charged, took)


def test_every_route_that_runs_a_prompt_answers_one_denser_than_its_estimate(base_url, redis_server, redis):
    key_id, secret = create_key(redis_server.url, f"routes-dense-{time.monotonic_ns()}")
    prompt = dense("digits", 300, seed=9) + dense("punctuation", 300, seed=10)
    floor = 2 * estimate(prompt)  # each answer's prompt is at least this: it was sized again
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=180)
    messages = [{"role": "user", "content": prompt}]
    prompts_used = []
    prompts_used.append(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4).usage)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    prompts_used.append([chunk.usage for chunk in stream if chunk.usage][-1])
    three = client.completions.create(model=MODEL, prompt=[prompt, prompt[:300], prompt[300:]], max_tokens=2).usage
    assert three.prompt_tokens >= floor
    prompts_used.append(three)
    response = client.responses.create(model=MODEL, input=prompt, max_output_tokens=4)
    assert response.usage.input_tokens >= floor
    claude = anthropic.Anthropic(base_url=base_url, api_key=secret, max_retries=0, timeout=180)
    message = claude.messages.create(model=MODEL, max_tokens=4, messages=messages)
    message_prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)  # Anthropic's split
    assert message_prompt >= floor
    assert all(usage.prompt_tokens >= floor for usage in prompts_used)
    found = wait_until_settled(redis, key_id)
    assert_within_reservations(found)
    charged = counters(redis, key_id)
    assert charged["tokens"] == (
        sum(u.prompt_tokens + u.completion_tokens for u in prompts_used)
        + response.usage.input_tokens
        + response.usage.output_tokens
        + message_prompt
        + message.usage.output_tokens
    )
    # Every request was charged once: the refused first attempts cost nothing.
    assert charged["requests"] == 5, charged
    assert len([r for r in found if r["status"] == "completed"]) == 5, found


def test_the_tokenizer_route_counts_a_dense_prompt_without_refusing_it(base_url, redis_server):
    _, secret = create_key(redis_server.url, f"tokenize-dense-{time.monotonic_ns()}", daily_token_budget=10)
    prompt = dense("emoji", 300, seed=4)
    answer = httpx.post(
        base_url + "/tokenize",
        headers={"authorization": f"Bearer {secret}"},
        json={"model": MODEL, "prompt": prompt},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["count"] > 4 * 300 // 2  # counted, and never refused by the budget of 10


def test_a_team_over_its_budget_can_still_stop_its_batch_and_fetch_its_files(base_url, redis):
    """Its budget lowered below what it used while its batch runs: every route that spends
    nothing answers (listing, reading, cancelling), what would spend is refused."""
    tag = time.monotonic_ns()
    team = admin("POST", base_url, "/admin/teams", name=f"over-{tag}", daily_token_budget=100_000)
    key = admin("POST", base_url, "/admin/keys", name=f"over-{tag}", team=team["id"])
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=key["secret"], max_retries=0, timeout=60)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    lines = jsonl([chat_line(f"l{i}", max_tokens=64) for i in range(200)])
    file = client.files.create(file=("lines.jsonl", lines), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    admin("PATCH", base_url, f"/admin/teams/{team['id']}", daily_token_budget=1)  # below what it used
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    error = refused.value.response.json()["error"]
    # Refused at once on either ingress replica, under the budget as it is now in Redis.
    assert error["type"] == "daily_token_budget" and "a daily budget of 1 tokens" in error["message"], error
    assert file.id in [f.id for f in client.files.list()]
    assert client.files.content(file.id).content == lines
    assert client.batches.retrieve(batch.id).id == batch.id
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    ended = wait_for(client, batch.id, lambda b: b.status == "cancelled", timeout_s=120)
    if ended.output_file_id:  # what ran before the cut is the tenant's to fetch
        assert client.files.content(ended.output_file_id).content
    assert client.batches.list().data[0].id == batch.id


def test_a_batch_of_dense_lines_never_passes_its_keys_budget(base_url, redis_server, redis):
    """Batch lines take the same path: each is refused at its estimate by the replica and
    admitted again at its real size, and the batch parks when the budget cannot hold the
    next line; what it is charged never passes the budget."""
    budget = 6_000
    key_id, secret = create_key(redis_server.url, f"batch-dense-{time.monotonic_ns()}", daily_token_budget=budget)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=60)
    lines = [
        {
            **chat_line(f"d{i}", max_tokens=20),
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": dense("emoji", 300, seed=i)}],
                "max_tokens": 20,
            },
        }
        for i in range(12)
    ]
    file = client.files.create(file=("dense.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    seen, still_since = -1, time.monotonic()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until it ends, or its charge stays put 5 s (parked on the budget)
        state = client.batches.retrieve(batch.id)
        charged = counters(redis, key_id).get("tokens", 0)
        if state.status in ("completed", "failed", "cancelled", "expired"):
            break
        if charged != seen:
            seen, still_since = charged, time.monotonic()
        elif time.monotonic() - still_since > 5:
            break
        time.sleep(0.5)
    if client.batches.retrieve(batch.id).status == "in_progress":
        client.batches.cancel(batch.id)
        wait_for(client, batch.id, lambda b: b.status == "cancelled", timeout_s=120)
    assert_within_reservations(wait_until_settled(redis, key_id))
    charged = counters(redis, key_id)
    ran = client.batches.retrieve(batch.id).request_counts.completed
    assert 1 <= ran < len(lines), ran  # some lines fit, not all: the budget decided
    assert charged["tokens"] <= budget, charged


def test_a_resized_request_counts_once_so_a_key_of_one_request_a_minute_can_send_it(base_url, redis_server, redis):
    """The admission at the estimate is withdrawn whole (its request of requests/min too)
    before the request is admitted again at its real size."""
    key_id, secret = create_key(redis_server.url, f"rpm1-dense-{time.monotonic_ns()}", requests_per_minute=1)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=120)
    prompt = dense("digits", 600, seed=5)
    usage = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2
    ).usage
    assert usage.prompt_tokens > estimate(prompt)  # it was resized
    assert_within_reservations(wait_until_settled(redis, key_id))
    charged = counters(redis, key_id)
    assert charged["requests"] == 1 and charged.get("refused", 0) == 0, charged
    assert charged["tokens"] == usage.total_tokens
    with pytest.raises(openai.RateLimitError):  # and the minute's one request is spent
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_a_render_is_a_request_so_refusals_at_the_real_size_never_pass_requests_per_minute(
    base_url, redis_server, redis
):
    """A key of 5 requests/min whose budget holds the estimate of a dense prompt but
    not its real count: each one admitted is rendered by the replica, then refused at
    its real size. Its request of requests/min stays charged, so of 20 such requests
    the replica renders 5 and the other 15 are refused before anything is rendered."""
    key_id, secret = create_key(
        redis_server.url, f"rpm5-renders-{time.monotonic_ns()}", requests_per_minute=5, daily_token_budget=400
    )
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=120)
    prompt = dense("digits", 600, seed=6)
    assert estimate(prompt) + 2 < 400  # admitted at its estimate; its real count (~600) is not
    before = call_replica(MODEL, "prompts_resized")
    refusals = []
    for _ in range(20):
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2)
        refusals.append(refused.value.code)
    assert call_replica(MODEL, "prompts_resized") - before == 5  # rendered: at most the key's requests/min
    assert len(set(refusals[:5])) == 1 and refusals[5:] == ["rate_limit_exceeded"] * 15, refusals
    assert refusals[0] != "rate_limit_exceeded"  # the five: refused by the budget at their real size
    wait_until_settled(redis, key_id)
    charged = counters(redis, key_id)
    assert charged.get("requests", 0) == 0 and charged.get("tokens", 0) == 0 and charged["refused"] == 20, charged
