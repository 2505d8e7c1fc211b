"""An operator's forced stop leaves no engine behind: the stack started as
`make run` starts it (`serve run` of the local config, in its own session),
serving; then `ray stop --force`. Every vLLM process must be gone within 10 s
(replicas/engine_guard.py: each dies with its parent), not reparented and
holding its memory.

`ray stop` stops every Ray process on this machine: this module refuses to run
while another Ray instance is up."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from http_checks import free_port
from stack import LOCAL_CONFIG, REPO, create_key, engine_processes

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent
STOPPED_WITHIN_S = 10


def ray_processes() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["name"]) if (p.info["name"] or "") in ("raylet", "gcs_server")]


@pytest.fixture(scope="module")
def serving(redis_server, tmp_path_factory):
    deadline = time.monotonic() + 30  # the previous module's Ray may still be exiting
    while ray_processes():
        assert time.monotonic() < deadline, "another Ray instance runs on this machine; `ray stop --force` would end it"
        time.sleep(0.5)
    assert not engine_processes(), "vLLM engine processes are already running"
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    port = free_port()
    config["http_options"]["port"] = port
    config["applications"][0]["args"]["redis_url"] = redis_server.url
    path = tmp_path_factory.mktemp("forced-stop") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    log = open(path.parent / "serve.log", "w")
    proc = subprocess.Popen([str(BIN / "serve"), "run", str(path)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "REDIS_URL": redis_server.url})
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        subprocess.run([str(BIN / "ray"), "stop", "--force"], capture_output=True, timeout=120)
        for leftover in engine_processes():  # never leave one to the next module
            leftover.kill()
        log.close()


def test_ray_stop_force_leaves_no_engine(serving, redis_server):
    base_url, proc = serving
    _, secret = create_key(redis_server.url, "forced-stop")
    deadline = time.monotonic() + 300
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    while True:
        assert proc.poll() is None, "serve run exited"
        try:
            if httpx.post(base_url + "/v1/chat/completions", json=body, timeout=30,
                          headers={"authorization": f"Bearer {secret}"}).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the stack did not come up"
        time.sleep(2)
    engines = engine_processes()
    assert len(engines) >= 2, engines  # one per model (chat + embeddings)

    stopped = subprocess.run([str(BIN / "ray"), "stop", "--force"], capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    stopped_at = time.monotonic()
    while engine_processes():
        assert time.monotonic() - stopped_at < STOPPED_WITHIN_S, (
            f"vLLM processes outlived `ray stop --force`: {[(p.pid, p.name()) for p in engine_processes()]}"
        )
        time.sleep(0.2)
