"""`make run`: the local stack says when it is ready (one block, and the first
requests after it succeed; Ray's and vLLM's output in the log file it names,
not in the terminal), and `llmctl status` shows what runs."""

from __future__ import annotations

import os

import httpx
import pytest
from stack import create_key

pytestmark = pytest.mark.e2e


def test_the_ready_banner_comes_when_every_model_answers(stack, redis_server):
    _, secret = create_key(redis_server.url, "first-request")
    stack.wait_ready()
    # The first requests a user sends after the banner succeed, for every model.
    headers = {"authorization": f"Bearer {secret}"}
    chat = httpx.post(
        stack.base_url + "/v1/chat/completions",
        headers=headers,
        timeout=60,
        json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert chat.status_code == 200, chat.text
    embedding = httpx.post(
        stack.base_url + "/v1/embeddings", headers=headers, timeout=60, json={"model": "minilm", "input": "hi"}
    )
    assert embedding.status_code == 200, embedding.text
    terminal = stack.log_path.read_text()
    assert f"URL      {stack.base_url}/v1" in terminal and "tiny-llama, minilm" in terminal
    assert str(stack.serve_log_path) in terminal
    # Ray's and vLLM's chatter went to the log file it names, not to the terminal.
    assert "EngineCore" not in terminal and "ServeReplica" not in terminal, terminal[-2000:]
    assert "ServeReplica" in stack.serve_log_path.read_text()


def test_llmctl_status_shows_what_runs(stack, redis_server):
    import json
    import subprocess

    from stack import BIN

    shown = subprocess.run(
        [str(BIN / "llmctl"), "status", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "REDIS_URL": redis_server.url},
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    status = json.loads(shown.stdout)
    deployments = status["serve"]["deployments"]
    assert status["serve"]["application"] == "RUNNING"
    for model in ("model-tiny-llama", "model-minilm"):
        assert deployments[model]["replicas"] == {"RUNNING": 1} and deployments[model]["target"] == 1
        engine = deployments[model]["engine"]
        assert set(engine) >= {"running", "waiting", "kv_cache_usage"} and 0 <= engine["kv_cache_usage"] <= 1, engine
    assert deployments["Ingress"]["replicas"] == {"RUNNING": 1}
    assert status["redis"]["reachable"] and status["redis"]["keys"] >= 1
    table = subprocess.run(
        [str(BIN / "llmctl"), "status"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "REDIS_URL": redis_server.url},
    ).stdout
    assert "model-tiny-llama" in table and "KV" in table and "redis: reachable" in table


def test_haproxys_statistics_and_metrics_answer_no_one_off_the_machine(stack):
    """HAProxy's statistics page (every backend, replica name and address) and its
    metrics answer on loopback only, and its admin socket is its user's alone
    (cluster/haproxy_edge.py); probed as a neighbour on the network would, with no
    credential."""
    import re
    import stat

    import psutil
    from stack import haproxy_processes

    stack.wait_ready()
    [proxy] = [process for process in haproxy_processes() if process.is_running()][:1]
    listening = {
        conn.laddr.port: conn.laddr.ip for conn in proxy.net_connections("tcp") if conn.status == psutil.CONN_LISTEN
    }
    for port in (8404, 9101):  # Ray's defaults: statistics, Prometheus exporter
        assert listening.get(port) == "127.0.0.1", listening
    assert httpx.get("http://127.0.0.1:8404/stats", timeout=10).status_code == 200  # for the operator, on the box
    for address in network_addresses():  # nothing answers there
        for port in (8404, 9101):
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://{address}:{port}/", timeout=5)
    # HAProxy binds a socket as <path>.<pid>.tmp, then renames it to <path>.
    sockets = [re.sub(r"\.\d+\.tmp$", "", conn.laddr) for conn in proxy.net_connections("unix") if conn.laddr]
    modes = {path: oct(stat.S_IMODE(os.stat(path).st_mode)) for path in sockets if os.path.exists(path)}
    assert modes and all(int(mode, 8) & 0o077 == 0 for mode in modes.values()), modes


def test_no_metrics_of_tenants_answer_off_the_machine(stack, redis_server):
    """Ray's metrics endpoints (the gateway's per-key and per-team counts and spend) answer
    on loopback only under `llmctl run` (a one-node Ray on 127.0.0.1: LOOPBACK_RAY in
    serve_app/ops/local_stack.py); and whatever else listens on the machine's network
    addresses, probed with no credential, serves no tenant's metrics."""
    import json
    import time
    from pathlib import Path

    import psutil
    from prometheus_server import SERVICE_DISCOVERY_FILE

    stack.wait_ready()
    _, secret = create_key(redis_server.url, "metrics-probe")
    chat = httpx.post(
        stack.base_url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {secret}"},
        json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    targets = [target for group in json.loads(Path(SERVICE_DISCOVERY_FILE).read_text()) for target in group["targets"]]
    assert targets and all(target.startswith("127.0.0.1:") for target in targets), targets
    deadline = time.monotonic() + 30  # Ray exports every 10 s
    while "metrics-probe" not in "".join(httpx.get(f"http://{t}/metrics", timeout=10).text for t in targets):
        assert time.monotonic() < deadline, "the key's metrics never reached Ray's endpoint"
        time.sleep(1)
    addresses = network_addresses()
    reachable = {
        conn.laddr.port
        for conn in psutil.net_connections("tcp")
        if conn.status == psutil.CONN_LISTEN and not conn.laddr.ip.startswith("127.")
    }
    for address in addresses:
        for port in sorted(reachable):
            try:
                text = httpx.get(f"http://{address}:{port}/metrics", timeout=3).text
            except httpx.HTTPError:
                continue  # not HTTP (Ray's gRPC), or closed
            assert "metrics-probe" not in text and "llm_gateway" not in text, (address, port)


def network_addresses() -> list[str]:
    """This machine's IPv4 addresses on its networks (not loopback): where a neighbour probes."""
    import socket

    import psutil

    return [
        address.address
        for addresses in psutil.net_if_addrs().values()
        for address in addresses
        if address.family == socket.AF_INET and not address.address.startswith("127.")
    ]


def test_no_one_sharing_the_admins_address_keeps_them_out(stack, redis_server):
    """As shipped (auth.admin_failures_per_minute 20), through the edge, which every client
    here reaches from one address (as behind a NAT, or a load balancer not listed in
    auth.trusted_proxies): a tenant's keys and tokens sent to the admin API count for
    nothing, wrong admin credentials are 401s and then 429s past the minute's bound,
    and the right credential still answers 200, on the admin API and the console's login."""
    import asyncio
    import time

    from serve_app.identity.admins import AdminStore
    from serve_app.identity.credential_guard import WINDOW_S
    from serve_app.redis_store.redis_client import connect

    async def named_admin() -> str:
        client = connect(redis_server.url)
        try:
            return (await AdminStore(client).create("lockout-ops", "test"))[1]
        finally:
            await client.aclose()

    stack.wait_ready()
    admin = asyncio.run(named_admin())
    _, tenant = create_key(redis_server.url, "admin-route-prober")

    def keys_listed(secret: str) -> httpx.Response:
        return httpx.get(stack.base_url + "/admin/keys", headers={"authorization": f"Bearer {secret}"}, timeout=30)

    def login(credential: str) -> httpx.Response:
        return httpx.post(stack.base_url + "/console/login", data={"credential": credential}, timeout=30)

    # The bound is per clock minute: near a minute's end, wait for the next one, so that
    # the guesses and the checks below (well under a second each) share one.
    if WINDOW_S - time.time() % WINDOW_S < 20:
        time.sleep(WINDOW_S - time.time() % WINDOW_S + 0.1)
    tokenish = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2ln"
    assert {keys_listed(secret).status_code for secret in [tenant, tokenish] * 15} == {401}  # 30, none counted
    guesses = [keys_listed("sk-admin-" + "x" * 43).status_code for _ in range(22)]
    assert guesses == [401] * 20 + [429] * 2, guesses
    assert login("sk-admin-wrong").status_code == 429  # the console's login counts with the API
    assert keys_listed(admin).status_code == 200  # the right credential, from the same address
    answer = login(admin)
    assert answer.status_code == 303 and answer.cookies.get("llm_console"), answer.text[:300]
