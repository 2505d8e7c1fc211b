"""OpenAI's organization Usage and Costs APIs on the real stack (Redis Cluster, Ray
Serve, vLLM): a key's chat, embeddings and a stream it hangs up on appear per model in
``GET /v1/organization/usage/completions``, in OpenAI's shape (the spec), summing to
what the key's request records say it was charged, and priced at the config's prices in
``GET /v1/organization/costs``; only an admin credential reads them, and `llmctl usage
--csv` prints the same figures."""

from __future__ import annotations

import csv
import io
import subprocess
import time

import httpx
import openai
import openai_spec
import pytest
from settled import inference, wait_until_settled
from stack import BIN, create_key

pytestmark = pytest.mark.e2e


def today() -> int:
    """Today's start (UTC), read when asked: a suite may run across midnight."""
    return int(time.time()) // 86400 * 86400


def test_a_keys_requests_appear_per_model_and_sum_to_what_its_records_charged(
    base_url, redis_server, redis, admin_token
):
    key_id, secret = create_key(redis_server.url, "usage-api")
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=120)
    for _ in range(2):
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    client.embeddings.create(model="minilm", input=["one", "two"])
    # A stream the client hangs up on: its usage is never reported, its reservation is charged.
    with client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "go"}],
        max_tokens=400,
        stream=True,
        extra_body={"min_tokens": 400, "ignore_eos": True},
    ) as stream:
        next(iter(stream))
    records = inference(wait_until_settled(redis, key_id, timeout_s=30))
    assert len(records) == 4

    params = {"start_time": today(), "group_by": ["api_key_id", "model"], "api_key_ids": key_id}
    assert (
        httpx.get(
            base_url + "/v1/organization/usage/completions",
            params=params,
            timeout=30,
            headers={"authorization": f"Bearer {secret}"},
        ).status_code
        == 401
    )  # an API key is no admin
    page = httpx.get(
        base_url + "/v1/organization/usage/completions",
        params=params,
        timeout=30,
        headers={"authorization": f"Bearer {admin_token}"},
    ).json()
    openai_spec.validate(page, "UsageResponse")
    [bucket] = page["data"]
    results = {r["model"]: r for r in bucket["results"]}
    assert set(results) == {"tiny-llama", "minilm"} and {r["api_key_id"] for r in results.values()} == {key_id}
    assert results["tiny-llama"]["num_model_requests"] == 3 and results["minilm"]["num_model_requests"] == 1
    assert results["minilm"]["output_tokens"] == 0 and results["minilm"]["input_tokens"] > 0
    charged = sum(int(r["total_tokens"]) for r in records)
    assert charged == sum(r["input_tokens"] + r["output_tokens"] + r["reserved_tokens"] for r in results.values())
    reserved = [r for r in records if r.get("usage") == "reserved"]
    assert results["tiny-llama"]["reserved_tokens"] == sum(int(r["total_tokens"]) for r in reserved) > 0

    # What it cost, at configs/local.yaml's prices (0.10 / 0.40 per million for tiny-llama, its cached
    # prompt tokens 0.025; 0.02 for minilm).
    spent = httpx.get(
        base_url + "/v1/organization/costs",
        timeout=30,
        headers={"authorization": f"Bearer {admin_token}"},
        params={"start_time": today(), "group_by": ["line_item", "api_key_id"], "api_key_ids": key_id},
    ).json()
    openai_spec.validate(spent, "UsageResponse")
    amounts = {r["line_item"]: r["amount"]["value"] for r in spent["data"][0]["results"]}
    chat, embed = results["tiny-llama"], results["minilm"]
    cached = chat["input_cached_tokens"]
    expected = {
        "tiny-llama, input": (chat["input_tokens"] - cached) * 0.10e-6 + cached * 0.025e-6,
        "tiny-llama, output": chat["output_tokens"] * 0.40e-6,
        "minilm, input": embed["input_tokens"] * 0.02e-6,
    }
    for line, value in expected.items():
        assert amounts[line] == pytest.approx(value, abs=1e-9), (line, amounts)
    # The hung-up stream's reservation is priced too (its prompt estimate and max_tokens).
    assert amounts["tiny-llama, reserved"] > 400 * 0.40e-6

    shown = subprocess.run(
        [str(BIN / "llmctl"), "usage", "--key", "usage-api", "--days", "1", "--csv"],
        env={"REDIS_URL": redis_server.url},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    rows = {row["model"]: row for row in csv.DictReader(io.StringIO(shown.stdout))}
    assert {model: int(row["num_model_requests"]) for model, row in rows.items()} == {"tiny-llama": 3, "minilm": 1}
    assert rows["tiny-llama"]["key_name"] == "usage-api"


def test_prompt_tokens_vllm_had_cached_are_counted_apart_and_pay_the_cached_price(
    base_url, redis_server, redis, admin_token
):
    """The same long prompt three times (unary, streamed, unary): vLLM finds its blocks
    in the prefix cache after the first, says so in `prompt_tokens_details`, and the
    usage and costs APIs count and price exactly what the responses said."""
    key_id, secret = create_key(redis_server.url, "usage-cached")
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=120)
    # About 1,000 tokens, unique to this run: no earlier test put it in the cache.
    prompt = [{"role": "user", "content": f"{time.time_ns()} " + "the license of the model is short. " * 120}]
    said = []
    first = client.chat.completions.create(model="tiny-llama", messages=prompt, max_tokens=2)
    said.append(first.usage)
    with client.chat.completions.create(
        model="tiny-llama", messages=prompt, max_tokens=2, stream=True, stream_options={"include_usage": True}
    ) as stream:
        said.append([chunk.usage for chunk in stream if chunk.usage][-1])
    said.append(client.chat.completions.create(model="tiny-llama", messages=prompt, max_tokens=2).usage)
    cached = [u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0 for u in said]
    assert cached[0] < said[0].prompt_tokens // 2, said  # the first time, little or nothing was cached
    assert all(c >= said[0].prompt_tokens // 2 for c in cached[1:]), said  # then most of it
    records = inference(wait_until_settled(redis, key_id, timeout_s=30))
    assert sorted(int(r["cached_tokens"]) for r in records) == sorted(cached)

    headers = {"authorization": f"Bearer {admin_token}"}
    page = httpx.get(
        base_url + "/v1/organization/usage/completions",
        timeout=30,
        headers=headers,
        params={"start_time": today(), "api_key_ids": key_id},
    ).json()
    openai_spec.validate(page, "UsageResponse")
    [row] = page["data"][0]["results"]
    prompt_tokens = sum(u.prompt_tokens for u in said)
    assert (row["input_tokens"], row["input_cached_tokens"]) == (prompt_tokens, sum(cached))
    spent = httpx.get(
        base_url + "/v1/organization/costs",
        timeout=30,
        headers=headers,
        params={"start_time": today(), "group_by": "line_item", "api_key_ids": key_id},
    ).json()
    amounts = {r["line_item"]: r["amount"]["value"] for r in spent["data"][0]["results"]}
    expected = (prompt_tokens - sum(cached)) * 0.10e-6 + sum(cached) * 0.025e-6
    assert amounts["tiny-llama, input"] == pytest.approx(expected, abs=1e-9)
    assert amounts["tiny-llama, input"] < prompt_tokens * 0.10e-6 * 0.8  # the cache made it cheaper


@pytest.mark.parametrize("path", ["/v1/organization/costs", "/v1/organization/usage/completions"])
@pytest.mark.parametrize(
    "params, param",
    [
        ({"start_time": "1099511000000", "end_time": "1099511600000"}, "start_time"),  # the year 36,812: was a 500
        ({"start_time": "²"}, "start_time"),  # a digit to str.isdigit, not to int(): was a 500
        ({"start_time": "0", "page": "9" * 14}, "page"),
    ],
)
def test_every_time_the_usage_apis_cannot_serve_is_a_400_naming_it(base_url, admin_token, path, params, param):
    answer = httpx.get(base_url + path, timeout=30, headers={"authorization": f"Bearer {admin_token}"}, params=params)
    assert answer.status_code == 400, answer.text[:300]
    assert answer.json()["error"]["param"] == param
