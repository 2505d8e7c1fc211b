"""`make run`, then Ctrl-C: the local stack (the shipped config, both models)
says when it is ready (one block, and the first requests after it succeed;
Ray's and vLLM's output in the log file it names, not in the terminal), then
ends within its bound, requests in flight end with an error, and nothing is
left: no Ray process, no vLLM engine, the port free.

A terminal's Ctrl-C is SIGINT to its foreground process group: here `llmctl
run` (what `make run` ends in) runs in a session of its own, and the test
signals that group. (`ray stop --force` and the other faults under load:
test_chaos_e2e.py.)"""

from __future__ import annotations

import os
import signal
import socket
import time

import httpx
import psutil
import pytest
import yaml

from http_checks import free_port
from stack import LOCAL_CONFIG, STACK_STOP_S, CliStack, assert_no_other_stack, create_key, engine_processes, ray_processes
from streaming_load import StreamingLoad

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(redis_server, tmp_path_factory):
    assert_no_other_stack()
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    config["http_options"]["port"] = free_port()
    config["applications"][0]["args"]["redis_url"] = redis_server.url
    local = CliStack(config, redis_server.url, tmp_path_factory.mktemp("local-stack"))
    local.start()
    try:
        yield local
    finally:
        local.kill()


def test_the_ready_banner_comes_when_every_model_answers(stack, redis_server):
    _, secret = create_key(redis_server.url, "first-request")
    deadline = time.monotonic() + 400
    while "Ready after" not in stack.log_path.read_text():
        assert stack.proc.poll() is None, stack.log_tail()
        assert time.monotonic() < deadline, stack.log_tail()
        time.sleep(0.2)
    # The first requests a user sends after the banner succeed, for every model.
    headers = {"authorization": f"Bearer {secret}"}
    chat = httpx.post(stack.base_url + "/v1/chat/completions", headers=headers, timeout=60,
                      json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200, chat.text
    embedding = httpx.post(stack.base_url + "/v1/embeddings", headers=headers, timeout=60,
                           json={"model": "minilm", "input": "hi"})
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

    shown = subprocess.run([str(BIN / "llmctl"), "status", "--json"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "REDIS_URL": redis_server.url})
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
    table = subprocess.run([str(BIN / "llmctl"), "status"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "REDIS_URL": redis_server.url}).stdout
    assert "model-tiny-llama" in table and "KV" in table and "redis: reachable" in table


def test_ctrl_c_ends_the_whole_stack_within_its_bound(stack, redis_server):
    _, secret = create_key(redis_server.url, "ctrl-c")
    stack.wait_serving(secret)
    assert len(engine_processes(workers=False)) == 2  # one per model (chat + embeddings)
    members = psutil.Process(stack.proc.pid).children(recursive=True)
    load = StreamingLoad(stack.base_url, secret, "tiny-llama", {"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 400, "extra_body": {"ignore_eos": True}})
    load.add(4)
    time.sleep(3)

    pressed_at = time.monotonic()
    os.killpg(stack.proc.pid, signal.SIGINT)
    assert stack.proc.wait(timeout=STACK_STOP_S + 10) == 0, stack.log_tail()
    took = time.monotonic() - pressed_at
    assert took <= STACK_STOP_S, f"the stack took {took:.1f} s to stop"
    alive = [p for p in members if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive
    assert not engine_processes() and not ray_processes()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", stack.port), timeout=1).close()
    load.stop()
    # the streams cut by the stop failed loudly; none looks complete without a finish reason
    assert load.outcomes["error"] >= 1 and set(load.outcomes) <= {"complete", "error"}, (load.outcomes, load.errors)
