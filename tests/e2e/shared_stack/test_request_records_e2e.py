"""Request records at scale, on the real stack (Redis Cluster, Ray Serve, vLLM): a
request's final record reaches the record sink (``records.sink_dir``) within seconds,
the same as Redis' copy, which Redis keeps only ``records.recent_s``; once Redis has
forgotten it, ``llmctl requests show`` and ``GET /admin/requests/{id}`` answer from
the sink, by completion id and by x-request-id; the outbox the ingresses ship through
is empty again after the traffic (serve_app/accounting/record_shipper.py)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from settled import wait_until_settled
from stack import BIN, create_key

from serve_app.redis_store import redis_names
from serve_app.settings import RecordsConfig

pytestmark = pytest.mark.e2e


def in_sink(records_dir: str, request_id: str, timeout_s: float = 15) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        for path in Path(records_dir).rglob("*.jsonl"):
            for line in path.read_text().splitlines():
                record = json.loads(line)
                if record["id"] == request_id:
                    return record
        assert time.monotonic() < deadline, f"{request_id} never reached the sink"
        time.sleep(0.2)


def test_a_final_record_leaves_redis_for_the_sink_and_is_found_there(
    base_url, redis_server, redis, records_dir, admin_token
):
    key_id, secret = create_key(redis_server.url, "records-at-scale")
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=120)
    reply = client.chat.completions.with_raw_response.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        extra_headers={"x-request-id": "records-e2e-client-id"},
    )
    completion = reply.parse()
    request_id = completion.id.removeprefix("chatcmpl-")
    wait_until_settled(redis, key_id)
    record = in_sink(records_dir, request_id)
    name = redis_names.request_record(key_id, request_id)
    held = {k.decode(): v.decode() for k, v in redis.hgetall(name).items()}
    assert record["status"] == held["status"] == "completed" and record["key_id"] == key_id
    assert record["completion_tokens"] == int(held["completion_tokens"]) == completion.usage.completion_tokens
    assert record["http_request_id"] == "records-e2e-client-id"
    assert 0 < redis.ttl(name) <= RecordsConfig().recent_s  # Redis keeps the recent hour, not the retention

    # Past Redis' window (forgotten here at once), the sink answers.
    redis.delete(
        name,
        redis_names.http_request("records-e2e-client-id"),
        redis_names.http_request("records-e2e-client-id", key_id),
    )
    for lookup in (completion.id, "records-e2e-client-id"):
        shown = subprocess.run(
            [str(BIN / "llmctl"), "requests", "show", lookup, "--records-dir", records_dir],
            env={"REDIS_URL": redis_server.url},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["id"] == request_id
    without_sink = subprocess.run(
        [str(BIN / "llmctl"), "requests", "show", completion.id, "--records-dir", ""],
        env={"REDIS_URL": redis_server.url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert without_sink.returncode == 1  # Redis alone has forgotten it
    by_admin = httpx.get(
        f"{base_url}/admin/requests/{completion.id}", timeout=30, headers={"authorization": f"Bearer {admin_token}"}
    )
    assert by_admin.status_code == 200 and by_admin.json()["completion_tokens"] == record["completion_tokens"]


def test_the_outbox_empties_after_a_burst(base_url, redis_server, redis, records_dir):
    key_id, secret = create_key(redis_server.url, "records-burst")
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=120)
    ids = [client.embeddings.create(model="minilm", input=f"burst {i}").id for i in range(20)]
    assert len(ids) == 20
    wait_until_settled(redis, key_id)
    deadline = time.monotonic() + 20
    while redis.xlen(redis_names.RECORD_OUTBOX):
        assert time.monotonic() < deadline, redis.xlen(redis_names.RECORD_OUTBOX)
        time.sleep(0.2)
    shipped = [
        json.loads(line) for path in Path(records_dir).rglob("*.jsonl") for line in path.read_text().splitlines()
    ]
    assert len([r for r in shipped if r["key_id"] == key_id]) == 20
