"""Start and stop the real stack (Ray + Serve + vLLM CPU engine) for a test module.

Tests use the shipped local config's models (configs/local.yaml), so what is
tested is what ``make run`` serves. Engines must not outlive the stack: after
shutdown the module waits for every vLLM EngineCore process to exit and fails
if one stays behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from copy import deepcopy
from pathlib import Path
from typing import Any

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
LOCAL_CONFIG = REPO / "configs" / "local.yaml"
APP_NAME = "llm"


def local_app_args(only: list[str] | None = None) -> dict[str, Any]:
    """The shipped local config's application args; ``only``: keep just these
    models (a module that uses one model starts faster without the others)."""
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    args = deepcopy(config["applications"][0]["args"])
    if only is not None:
        args["models"] = [model for model in args["models"] if model["name"] in only]
    return args


def engine_processes() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue  # exited (holds no memory), not reaped yet
            text = (proc.info["name"] or "") + " " + " ".join(proc.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        # vLLM titles its processes VLLM::EngineCore_DP0, VLLM::Worker_TP0, ...
        if ("EngineCore" in text or "VLLM::Worker" in text) and proc.pid != os.getpid():
            found.append(proc)
    return found


def replica_engine_processes(model: str | None = None) -> list[psutil.Process]:
    """Engine processes started by Serve replicas (not by a bare `vllm serve`),
    only those of ``model``'s replicas when given."""
    from replicas.config import deployment_name

    marker = "ServeReplica" + (f":{APP_NAME}:{deployment_name(model)}" if model else "")

    def under_replica(proc: psutil.Process) -> bool:
        try:
            return any(marker in p.name() + " ".join(p.cmdline()) for p in proc.parents())
        except psutil.Error:
            return False

    return [proc for proc in engine_processes() if under_replica(proc)]


def wait_for_no_engines(timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while engine_processes():
        if time.monotonic() > deadline:
            leftover = [p.pid for p in engine_processes()]
            raise AssertionError(f"vLLM EngineCore processes left behind: {leftover}")
        time.sleep(0.5)


@contextlib.contextmanager
def serve_stack(
    args: dict[str, Any], port: int, *, dashboard: bool = False, ray_system_config: dict | None = None
) -> Iterator[str]:
    """Run the application built from ``args``; yield its base URL.

    ``dashboard``: start Ray's dashboard too (it writes the Prometheus
    service-discovery file); ``ray_system_config``: Ray internals (e.g. a shorter
    metrics export interval)."""
    import ray
    from ray import serve

    from serve_app.app import build_app

    ray.init(include_dashboard=dashboard, log_to_driver=False, logging_level="WARNING",
             _system_config=ray_system_config or {})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            wait_for_no_engines()


def create_key(redis_url: str, name: str, **limits) -> tuple[str, str]:
    """Create an API key in the stack's Redis; return (key id, secret)."""
    import redis.asyncio

    from serve_app.keys import KeyLimits, KeyStore

    async def create():
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            record, secret = await KeyStore(client).create(name, KeyLimits(**limits))
            return record.id, secret
        finally:
            await client.aclose()

    return asyncio.run(create())


def call_replica(model_name: str, method: str, *args):
    """Call a model replica's method from (synchronous) test code.

    Handles are made and awaited on one long-lived event loop: with Ray
    Serve's throughput mode the router runs on the caller's loop, not on a
    thread of its own, and Serve caches handles (with their loop).
    """
    from ray import serve

    from replicas.config import deployment_name

    async def call():
        handle = serve.get_deployment_handle(deployment_name(model_name), app_name=APP_NAME)
        return await getattr(handle, method).remote(*args)

    return asyncio.run_coroutine_threadsafe(call(), _driver_loop()).result(timeout=60)


_loop: asyncio.AbstractEventLoop | None = None


def _driver_loop() -> asyncio.AbstractEventLoop:
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
        threading.Thread(target=_loop.run_forever, name="test-driver-loop", daemon=True).start()
    return _loop
