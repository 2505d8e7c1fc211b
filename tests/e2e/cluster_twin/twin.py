"""The local twin of a cluster: Ray's own launcher and CLIs on this machine
(`ray up cluster.local.yaml`, fake worker nodes the autoscaler adds and removes),
and the Serve config this package deploys on it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from copy import deepcopy
from pathlib import Path

import httpx
import yaml
from stack import REPO, quick_engines

BIN = Path(sys.executable).parent
DASHBOARD = "http://127.0.0.1:8265"
TINY, SMALL, EMBED, PIRATE = "tiny-llama", "small-llama", "minilm", "small-llama-pirate"
THINKING = "tiny-llama-thinking"  # added to the shipped config here


def cli(*args: str, env: dict, timeout: float = 300) -> str:
    done = subprocess.run(
        [str(BIN / args[0]), *args[1:]], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
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


def twin_config(tmp_path: Path, port: int, adapter_dir: Path, only: list[str] | None = None, **changes) -> Path:
    """configs/multi.yaml as shipped, but for: the port, an adapter folder for
    small-llama (so '<model>:<folder>' adapters are tested), a "thinking" variant
    of the demo model for vLLM's reasoning parser, engines eager
    (stack.quick_engines), and ``changes`` per model (a rollout's new version);
    ``only``: these models alone (the others are removed from the deployment)."""
    config = yaml.safe_load((REPO / "configs" / "multi.yaml").read_text())
    config["http_options"]["port"] = port
    models = config["applications"][0]["args"]["models"]
    by_name = {model["name"]: model for model in models}
    by_name[SMALL]["lora"]["dir"] = str(adapter_dir)
    models.append(
        {
            **deepcopy(by_name[TINY]),
            "name": THINKING,
            "aliases": [],
            "cpus_per_replica": 0.25,  # the rollout's surge replica may need a second worker node
            "engine_kwargs": {
                "max_model_len": 512,
                "reasoning_parser": "deepseek_r1",
                # grammar from the first token, so a test can make the random
                # weights "think" (the parser reads the tags)
                "structured_outputs_config": {"backend": "xgrammar", "enable_in_reasoning": True},
            },
        }
    )
    for name, change in changes.items():
        by_name[name].update(change)
    if only is not None:
        models[:] = [model for model in models if model["name"] in only]
    quick_engines(models)
    # This run's request records: the package's folder, never the home directory's.
    config["applications"][0]["args"]["records"] = {"sink_dir": str(tmp_path / "records")}
    path = tmp_path / f"multi-{len(changes)}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path
