"""One cluster for this package: `ray up cluster.local.yaml` (Ray's launcher, a
fake multi-node cluster on this machine), `serve deploy` of configs/multi.yaml as
twin.twin_config changes it, a real Redis. Modules run in their numbered order:
the multi-model tests on the deployed config, then the cluster workflow (a
rollout, `serve shutdown`), which changes and removes the deployment.

`ray up` of the twin would stop another Ray instance on this machine: the
package waits for the previous module's to go, and refuses to start otherwise."""

from __future__ import annotations

import os
import shutil
import time

import pytest
from ports import free_port
from redis_server import running_redis
from stack import ray_processes, wait_for_no_engines

from cluster_twin.twin import BIN, alive_nodes, cli, serve_app, twin_config, wait_until


@pytest.fixture(scope="package")
def redis_server():
    with running_redis() as server:
        yield server


@pytest.fixture(scope="package")
def adapter_dir(tmp_path_factory):
    from replicas.demo_lora import build_demo_adapter

    folder = tmp_path_factory.mktemp("adapters")
    # The very adapter the config names `small-llama-pirate`, as a folder.
    shutil.copytree(build_demo_adapter(size="small"), folder / "pirate-copy")
    return folder


@pytest.fixture(scope="package")
def cluster(redis_server):
    deadline = time.monotonic() + 30  # the previous module's stack may still be going away
    while ray_processes():
        if time.monotonic() > deadline:
            pytest.fail(
                f"another Ray instance runs on this machine; `ray up` of the local twin would stop it: "
                f"{ray_processes()}"
            )
        time.sleep(0.5)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    # Token authentication, as Ray enables it by default: `ray start` and the CLIs share ~/.ray/auth_token.
    env.update(
        RAY_FAKE_CLUSTER="1", RAY_AUTH_MODE="token", REDIS_URL=redis_server.url, PATH=f"{BIN}:{env.get('PATH', '')}"
    )
    cli("ray", "get-auth-token", "--generate", env=env)
    cli("ray", "up", "-y", "cluster.local.yaml", env=env)
    try:
        yield env
    finally:
        cli("ray", "down", "-y", "cluster.local.yaml", env=env)
        wait_until(lambda: not ray_processes(), 60, "Ray processes to exit after ray down")
        wait_for_no_engines()


@pytest.fixture(scope="package")
def deployed(cluster, adapter_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    assert alive_nodes(cluster) == 1  # the head alone
    cli("serve", "deploy", str(twin_config(tmp, port, adapter_dir)), env=cluster)
    wait_until(lambda: serve_app().get("status") == "RUNNING", 600, "the multi-model app to run")
    return {"url": f"http://127.0.0.1:{port}", "tmp": tmp, "port": port}


@pytest.fixture(scope="package")
def base_url(deployed):
    return deployed["url"]
