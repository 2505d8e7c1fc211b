"""Metrics and access log on the real stack: a short mixed load (JSON answers,
streams, a cancelled stream, 429s, a 401, a 404), then the names and labels on
Ray's metrics endpoint of this node (gateway and vLLM metrics side by side) and
the JSON access lines the ingress wrote."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from http_checks import free_port
from stack import create_key, local_app_args, serve_stack

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "hi"}]
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")


@pytest.fixture(scope="module")
def base_url(redis_server):
    args = {**local_app_args(), "redis_url": redis_server.url}
    args["models"] = [model for model in args["models"] if model["name"] == MODEL]
    with serve_stack(args, port=free_port()) as url:
        yield url


def metrics_url() -> str:
    import ray

    [node] = [node for node in ray.nodes() if node["Alive"]]
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    found = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match and not line.startswith("#"):
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match["labels"] or ""))
            found.append((match["name"], labels, float(match["value"])))
    return found


def total(found, name: str, **labels) -> float:
    return sum(value for metric, have, value in found if metric == name and labels.items() <= have.items())


@pytest.fixture(scope="module")
def load(base_url, redis_server):
    """The mixed load, once; returns when the metrics endpoint shows all of it."""
    _, secret = create_key(redis_server.url, "telemetry")
    _, limited = create_key(redis_server.url, "telemetry-limited", requests_per_minute=1)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=secret, max_retries=0, timeout=120)
    for _ in range(3):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    for _ in range(2):
        for _ in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, stream=True):
            pass
    # A stream the client abandons after its first chunk.
    with httpx.Client(base_url=base_url, timeout=60, headers={"authorization": f"Bearer {secret}"}) as http:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1000, "min_tokens": 1000, "ignore_eos": True,
                "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            next(response.iter_lines())
        refused = [http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
                             headers={"authorization": f"Bearer {limited}"}) for _ in range(3)]
        assert [r.status_code for r in refused].count(429) == 2
        assert http.post("/v1/chat/completions", json={}, headers={"authorization": "Bearer nope"}).status_code == 401
        assert http.post("/v1/chat/completions", json={"model": "nope", "messages": MESSAGES}).status_code == 404
    deadline = time.monotonic() + 90
    while True:  # Ray exports every few seconds
        found = samples(httpx.get(metrics_url(), timeout=10).text)
        if (total(found, "ray_llm_gateway_client_disconnects_total") >= 1
                and total(found, "ray_llm_gateway_requests_total", status="200") >= 6
                and total(found, "ray_llm_gateway_rate_limit_refusals_total") >= 2):
            return found
        assert time.monotonic() < deadline, sorted({name for name, _, _ in found if "llm_gateway" in name})
        time.sleep(2)


def test_requests_by_model_route_and_status(load):
    assert total(load, "ray_llm_gateway_requests_total", model=MODEL, route="openai", status="200") >= 6
    assert total(load, "ray_llm_gateway_requests_total", model=MODEL, status="429") == 2
    assert total(load, "ray_llm_gateway_requests_total", model="unknown", status="401") >= 1
    assert total(load, "ray_llm_gateway_requests_total", status="404") >= 1


def test_refusals_by_limit_kind(load):
    assert total(load, "ray_llm_gateway_rate_limit_refusals_total", model=MODEL, limit="requests") == 2


def test_latency_histograms_and_tokens(load):
    for histogram in ("request_duration_seconds", "time_to_first_token_seconds", "time_per_output_token_seconds",
                      "admission_seconds"):
        assert total(load, f"ray_llm_gateway_{histogram}_count") > 0, histogram
        assert total(load, f"ray_llm_gateway_{histogram}_bucket", le="+Inf") > 0, histogram
    assert total(load, "ray_llm_gateway_time_to_first_token_seconds_count", model=MODEL) == 3  # 2 streams + cancelled
    assert total(load, "ray_llm_gateway_prompt_tokens_total", model=MODEL) > 0
    assert total(load, "ray_llm_gateway_completion_tokens_total", model=MODEL) >= 3 * 1 + 2 * 1
    assert total(load, "ray_llm_gateway_client_disconnects_total", model=MODEL) == 1


def test_in_flight_gauge_returns_to_zero(load):
    names = {name for name, _, _ in load}
    assert "ray_llm_gateway_requests_in_flight" in names
    deadline = time.monotonic() + 30
    while total(samples(httpx.get(metrics_url(), timeout=10).text), "ray_llm_gateway_requests_in_flight") != 0:
        assert time.monotonic() < deadline
        time.sleep(2)


def test_labels_stay_low_cardinality(load):
    gateway = [(name, labels) for name, labels, _ in load if name.startswith("ray_llm_gateway_")]
    assert gateway and not any("key_name" in labels for _, labels in gateway)  # opt-in only
    allowed = {"model", "route", "status", "limit", "operation", "kind", "le"}
    ray_added = {"Component", "NodeAddress", "SessionName", "Version", "WorkerId", "ReplicaId", "JobId",
                 "otel_scope_name", "otel_scope_version", "otel_scope_schema_url"}
    for name, labels in gateway:
        assert set(labels) - ray_added <= allowed, (name, labels)


def test_vllm_engine_metrics_are_on_the_same_endpoint(load):
    names = {name for name, _, _ in load}
    for wanted in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                   "generation_tokens_total"):
        assert any(name.startswith("ray_vllm") and wanted in name for name in names), wanted


def test_access_log_has_one_json_line_per_request_without_text(load):
    lines = []
    for path in Path("/tmp/ray/session_latest/logs").glob("worker-*.out"):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith('{"ts":'):
                lines.append(json.loads(line))
    by_status = {}
    for entry in lines:
        by_status.setdefault(entry["status"], []).append(entry)
    assert len(by_status.get(200, [])) >= 6 and len(by_status[429]) == 2
    refused = by_status[429][0]
    assert refused["limit"] == "requests" and int(refused["retry_after"]) >= 1 and refused["key_id"]
    streamed = [entry for entry in by_status[200] if entry["stream"]]
    assert len(streamed) == 3 and all("ttft_ms" in entry for entry in streamed)
    assert sum(1 for entry in streamed if entry.get("cancelled")) == 1
    assert all(entry["request_id"] for entry in lines)
    text = json.dumps(lines)
    assert "hi" not in {value for entry in lines for value in entry.values() if isinstance(value, str)}
    assert "content" not in text and "messages" not in text
