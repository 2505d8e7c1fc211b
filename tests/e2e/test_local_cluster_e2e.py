"""The cluster workflow on this machine, through Ray's own launcher and CLIs:
`ray up cluster.local.yaml`, `serve deploy` of the multi-model config (more than
the head can hold, so Ray's autoscaler adds a fake worker node), SDK calls, a
rollout of a changed model with `serve deploy` while streams are in flight (none
may fail), `serve shutdown` (the idle worker is removed), `ray down`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from http_checks import free_port
from stack import REPO, create_key, eager_engines, ray_processes, wait_for_no_engines
from streaming_load import StreamingLoad

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BIN = Path(sys.executable).parent
DASHBOARD = "http://127.0.0.1:8265"
CHAT = "tiny-llama"
STREAM = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "temperature": 0,
          "extra_body": {"min_tokens": 200, "ignore_eos": True}}


def cli(*args: str, env: dict, timeout: float = 300) -> str:
    done = subprocess.run([str(BIN / args[0]), *args[1:]], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def alive_nodes(env: dict) -> int:
    return len(json.loads(cli("ray", "list", "nodes", "--format=json", "--filter", "state=ALIVE", env=env)))


def dashboard_headers() -> dict:
    """Ray's token authentication (on by default): the token `ray start` uses."""
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    return {"authorization": f"Bearer {token}"}


def wait_until(check, timeout_s: float, what: str, interval_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = check()
        except Exception:  # the dashboard may be (re)starting
            value = None
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval_s)


def serve_app() -> dict:
    applications = httpx.get(f"{DASHBOARD}/api/serve/applications/", headers=dashboard_headers(), timeout=10).json()[
        "applications"
    ]
    return applications.get("llm") or {}


def running_replica_ids(deployment: str) -> set[str]:
    replicas = serve_app()["deployments"][deployment]["replicas"]
    return {replica["replica_id"] for replica in replicas if replica["state"] == "RUNNING"}


@pytest.fixture(scope="module")
def cluster(redis_server, tmp_path_factory):
    deadline = time.monotonic() + 30  # the previous module's stack may still be going away
    while ray_processes():
        if time.monotonic() > deadline:
            pytest.fail(f"another Ray instance runs on this machine; `ray up` of the local twin would stop it: "
                        f"{ray_processes()}")
        time.sleep(0.5)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    # Token authentication, as Ray enables it by default: `ray start` and the CLIs share ~/.ray/auth_token.
    env.update(RAY_FAKE_CLUSTER="1", RAY_AUTH_MODE="token", REDIS_URL=redis_server.url,
               PATH=f"{BIN}:{env.get('PATH', '')}")
    cli("ray", "get-auth-token", "--generate", env=env)
    cli("ray", "up", "-y", "cluster.local.yaml", env=env)
    try:
        yield env
    finally:
        cli("ray", "down", "-y", "cluster.local.yaml", env=env)
        wait_until(lambda: not ray_processes(), 60, "Ray processes to exit after ray down")
        wait_for_no_engines()


def multi_config(tmp_path: Path, port: int, **changes) -> Path:
    config = yaml.safe_load((REPO / "configs" / "multi.yaml").read_text())
    config["http_options"]["port"] = port
    models = {model["name"]: model for model in config["applications"][0]["args"]["models"]}
    for name, change in changes.items():
        models[name].update(change)
    eager_engines(list(models.values()))
    path = tmp_path / f"multi-{len(changes)}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def deployed(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    assert alive_nodes(cluster) == 1  # the head alone
    cli("serve", "deploy", str(multi_config(tmp, port)), env=cluster)
    wait_until(lambda: serve_app().get("status") == "RUNNING", 600, "the multi-model app to run")
    return {"url": f"http://127.0.0.1:{port}", "tmp": tmp, "port": port}


def test_more_replicas_than_the_head_holds_adds_a_worker_node(deployed, cluster):
    assert alive_nodes(cluster) >= 2


def test_every_model_answers_through_the_cluster(deployed, redis_server):
    _, secret = create_key(redis_server.url, "local-cluster")
    client = openai.OpenAI(base_url=deployed["url"] + "/v1", api_key=secret, max_retries=0, timeout=120)
    for model in ("tiny-llama", "small-llama", "small-llama-pirate"):
        assert client.chat.completions.create(model=model, messages=STREAM["messages"], max_tokens=4).model == model
    assert len(client.embeddings.create(model="minilm", input="hi").data[0].embedding) == 384


def test_rollout_with_serve_deploy_finishes_every_stream_in_flight(deployed, cluster, redis_server):
    _, secret = create_key(redis_server.url, "rollout")
    before = running_replica_ids("model-tiny-llama")
    load = StreamingLoad(deployed["url"], secret, CHAT, STREAM)
    try:
        load.add(3)
        time.sleep(3)
        # A new version of the model: new engine options, so Serve replaces its replicas.
        new = multi_config(deployed["tmp"], deployed["port"], **{CHAT: {"engine_kwargs": {"max_model_len": 2048, "max_num_seqs": 32}}})
        cli("serve", "deploy", str(new), env=cluster)
        wait_until(lambda: (ids := running_replica_ids("model-tiny-llama")) and not ids & before, 600,
                   "the new tiny-llama replica to replace the old one")
        time.sleep(3)  # streams keep flowing on the new replica
    finally:
        load.stop()
    print(f"\nstreams during the rollout: {dict(load.outcomes)}")
    assert load.outcomes["error"] == 0, load.errors[:3]
    assert set(load.outcomes) == {"complete"} and load.outcomes["complete"] >= 3


def test_removing_the_load_removes_the_worker_node(deployed, cluster):
    cli("serve", "shutdown", "-y", env=cluster)
    wait_until(lambda: alive_nodes(cluster) == 1, 300, "the idle worker node to be removed")
