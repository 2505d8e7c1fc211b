"""What the soak runs on: a Redis Cluster of real ``redis-server`` processes, each
node behind a chaos proxy (the gateway reaches Redis only through them), and the
gateway on the ``ray up`` twin of a cluster (cluster.local.yaml: Ray's launcher,
fake worker nodes its autoscaler adds) with many ingress replicas, models on the
paced instant engine (replicas/instant_engine.py) and one on real vLLM CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from soak.chaos_proxy import ChaosProxy

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from ports import free_port  # noqa: E402
from redis_server import RedisClusterServers, RedisServer, _cli  # noqa: E402

BIN = Path(sys.executable).parent
APP = "llm"
PACED, PACED_DIRECT, VLLM_MODEL = "paced", "paced-direct", "tiny-llama"
# Illustrative prices (USD per million tokens), so money budgets have something to count.
PRICES = {"prompt_per_million": 1.0, "completion_per_million": 2.0}
# The paced models' ``failover.first_token_timeout_s``: a stream silent this long on a
# stalled replica is moved to another (the model-stall fault). Their first token comes
# in one token interval, so any honest stream beats it by far.
PACED_FIRST_TOKEN_TIMEOUT_S = 5.0


class ProxiedRedisCluster(RedisClusterServers):
    """3 primaries with a replica each (tests/redis_server.py); every node announces
    its proxy's port, so the gateway's cluster client (seeded with the proxies, and
    following CLUSTER SLOTS) never talks to a node but through its proxy."""

    def __init__(self, primaries: int = 3):
        ports = [free_port() for _ in range(2 * primaries)]
        super().__init__(primaries, 1, announce_ports=ports)
        self.proxies = [ChaosProxy(port, node.port) for port, node in zip(ports, self.nodes)]

    def start(self) -> None:
        for proxy in self.proxies:
            proxy.start()
        super().start()

    def healthy(self) -> bool:
        """Every node up and ok, three primaries, every replica synced."""
        if any(node.proc is None for node in self.nodes):
            return False
        roles = [_cli(node.port, "info", "replication") for node in self.nodes]
        return (
            all("cluster_state:ok" in _cli(node.port, "cluster", "info") for node in self.nodes)
            and sum("role:master" in role for role in roles) == self.primaries
            and all("master_link_status:up" in role for role in roles if "role:slave" in role)
        )

    def node_with_role(self, role: str) -> RedisServer:
        for node in self.nodes:
            if node.proc is not None and f"role:{role}" in _cli(node.port, "info", "replication"):
                return node
        raise LookupError(role)

    def stop(self) -> None:
        super().stop()
        for proxy in self.proxies:
            proxy.stop()


def serve_config(
    port: int,
    run_dir: Path,
    ingress_replicas: int,
    paced_replicas: int,
    token_interval_s: float,
    with_vllm: bool,
    lease_s: float,
) -> dict[str, Any]:
    """The deployment the soak runs: the shipped app, its limits as shipped but for
    the concurrency lease, the run's (the ledger waits out two at rest)."""
    paced = {
        "engine": "replicas.instant_engine:start_instant",
        "cpus_per_replica": 0.05,
        "queue_timeout_s": 60,
        "engine_kwargs": {"token_interval_s": token_interval_s},
        "pricing": PRICES,
        "failover": {"first_token_timeout_s": PACED_FIRST_TOKEN_TIMEOUT_S},
        "deployment": {"num_replicas": paced_replicas, "max_ongoing_requests": 512},
    }
    models = [
        {"name": PACED, **paced},
        {"name": PACED_DIRECT, "direct_route": True, **paced},
    ]
    if with_vllm:
        models.append(
            {
                "name": VLLM_MODEL,
                "source": "demo",
                "cpus_per_replica": 0.5,
                "direct_route": True,
                "engine_kwargs": {"max_model_len": 2048, "max_num_seqs": 64, "enforce_eager": True},
                "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                "pricing": PRICES,
                "deployment": {"num_replicas": 1, "max_ongoing_requests": 128},
            }
        )
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": APP,
                "route_prefix": "/",
                "import_path": "serve_app.app:build_app",
                "args": {
                    "ingress": {
                        "deployment": {
                            "num_replicas": ingress_replicas,
                            "max_ongoing_requests": 512,
                            "ray_actor_options": {"num_cpus": 0.1},
                        }
                    },
                    "quota": {"concurrency_lease_s": lease_s},
                    "records": {"sink_dir": str(run_dir / "records")},
                    # A batch a failover lost from the runners' set is found again within 20 s
                    # (300 as shipped): the harness gives batches 120 s to end after the load.
                    "batch": {"files_dir": str(run_dir / "files"), "reconcile_s": 20},
                    "telemetry": {"access_log": False},
                    "models": models,
                },
            }
        ],
    }


class Twin:
    """`ray up cluster.local.yaml` and `serve deploy` of ``config``, torn down whole."""

    def __init__(self, redis_url: str, admin_token: str, run_dir: Path):
        self.env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
        self.env.update(
            RAY_FAKE_CLUSTER="1",
            RAY_AUTH_MODE="token",
            REDIS_URL=redis_url,
            LLM_CLUSTER_ADMIN_TOKEN=admin_token,
            PATH=f"{BIN}:{self.env.get('PATH', '')}",
        )
        self.run_dir = run_dir

    def cli(self, *args: str, timeout: float = 300) -> str:
        done = subprocess.run(
            [str(BIN / args[0]), *args[1:]], env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    def up(self) -> None:
        self.cli("ray", "get-auth-token", "--generate")
        self.cli("ray", "up", "-y", "cluster.local.yaml")

    def deploy(self, config: dict[str, Any], timeout_s: float = 600) -> None:
        from serve_app.app import with_direct_apps

        path = self.run_dir / "serve.yaml"
        path.write_text(yaml.safe_dump(with_direct_apps(config)))
        self.cli("serve", "deploy", str(path))
        deadline = time.monotonic() + timeout_s
        while self.app_status() != "RUNNING":
            assert time.monotonic() < deadline, f"the soak app did not start: {self.app_status()}"
            time.sleep(2)

    def app_status(self) -> str:
        """RUNNING when every application (the gateway's, each direct route's) runs."""
        try:
            token = (Path.home() / ".ray" / "auth_token").read_text().strip()
            answer = httpx.get(
                "http://127.0.0.1:8265/api/serve/applications/",
                headers={"authorization": f"Bearer {token}"},
                timeout=10,
            ).json()
            statuses = {app.get("status", "") for app in answer["applications"].values()}
            return statuses.pop() if len(statuses) == 1 and APP in answer["applications"] else ",".join(statuses)
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            return ""

    def nodes(self) -> int:
        return len(json.loads(self.cli("ray", "list", "nodes", "--format=json", "--filter", "state=ALIVE")))

    def down(self) -> None:
        try:
            self.cli("ray", "down", "-y", "cluster.local.yaml", timeout=180)
        finally:
            deadline = time.monotonic() + 60
            while _ray_processes() and time.monotonic() < deadline:
                time.sleep(0.5)


def _ray_processes() -> list[psutil.Process]:
    return [
        p
        for p in psutil.process_iter(["name", "status"])
        if (p.info["name"] or "") in ("raylet", "gcs_server") and p.info["status"] != psutil.STATUS_ZOMBIE
    ]


def processes(mark: str) -> list[psutil.Process]:
    """Live processes whose command line holds ``mark`` (a Serve replica's actor name)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status", "name"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if mark in " ".join(proc.info["cmdline"] or []) or proc.info["name"] == mark:
            found.append(proc)
    return found


def run_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="soak-"))
