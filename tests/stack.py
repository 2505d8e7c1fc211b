"""Start and stop the real stack (Ray + Serve + vLLM CPU engine) for a test module.

Tests use the shipped local config's models (configs/local.yaml), direct routes
included, so what is tested is what ``make run`` serves (``LOCAL_SHAPE`` says what
differs). Engines must not outlive the stack: after
shutdown the module waits for every vLLM EngineCore process to exit and fails
if one stays behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from copy import deepcopy
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
LOCAL_CONFIG = REPO / "configs" / "local.yaml"
APP_NAME = "llm"


def quick_engines(models: list[dict[str, Any]], one_process: bool = True) -> list[dict[str, Any]]:
    """``models`` with vLLM's torch.compile warm-up off (``enforce_eager``) and,
    with ``one_process``, the engine's executor inside its EngineCore process.

    Compilation changes how fast an engine decodes, never what the API answers,
    and it costs 15-40 s of every engine start on this 2-core box (measured:
    engine init 39.5 s cold / 14.8 s cached vs 0.6 s eager), which the suite pays
    at every stack, restart and scale-up. vLLM's CPU platform runs its model in a
    Worker process of its own (the multiprocess executor), a third process importing
    torch and vLLM per engine; ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the
    executor in EngineCore (vLLM's one-process executor, the one it uses for a
    single GPU): a stack of one model ready in 45 s instead of 62, of two in 62
    instead of 92 (/tmp timing of ``serve_stack``, one run each). The shipped
    configs keep both (c=1 decode is 1.3-1.8x faster compiled; the CPU platform's
    choice of executor), tests/e2e/local_stack/ runs configs/local.yaml unchanged
    and the chaos module kills engines of the shipped executor, so both paths stay
    tested."""
    for model in models:
        model["engine_kwargs"] = {**model.get("engine_kwargs", {}), "enforce_eager": True}
        if one_process:
            model["env"] = {**model.get("env", {}), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return models


# What every test stack changes in configs/local.yaml's application args, and why: the
# shipped shape otherwise, so what is tested is what `make run` serves (direct routes
# included). A stack's own changes are declared beside it (its ``SHAPE``);
# tests/unit/test_stack_shapes.py fails on any other difference.
LOCAL_SHAPE = {
    "models.*.engine_kwargs.enforce_eager": "quick_engines: no torch.compile warm-up (speed only)",
    "models.*.env.VLLM_ENABLE_V1_MULTIPROCESSING": "quick_engines: the executor inside EngineCore (speed only)",
    "batch": "batch files in a directory of this run; leases, polls and reconciles in seconds",
    "records": "request records in a directory of this run",
}


def local_app_args(only: list[str] | None = None, *, ingress_path: bool = False) -> dict[str, Any]:
    """The shipped local config's application args, engines quick to start
    (``quick_engines``); ``only``: keep just these models (a module that uses one
    model starts faster without the others). The models keep their ``direct_route``
    as shipped (``/v1`` chat, completions and embeddings in one hop to the model's
    replica); ``ingress_path``: without it, for a test about the ingress' own path (it
    says so), every request through the ingress."""
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    args = deepcopy(config["applications"][0]["args"])
    if only is not None:
        args["models"] = [model for model in args["models"] if model["name"] in only]
    quick_engines(args["models"])
    if ingress_path:
        for model in args["models"]:
            model.pop("direct_route", None)
    # Batch files in a directory of this test run, batches resumed fast after a runner dies
    # and the runners' set reconciled within seconds.
    args["batch"] = {
        "files_dir": tempfile.mkdtemp(prefix="llm-files-"),
        "lease_s": 3.0,
        "poll_s": 0.2,
        "reconcile_s": 5.0,
    }
    args["records"] = {"sink_dir": tempfile.mkdtemp(prefix="llm-records-")}  # this run's request records
    return args


def shipped_app_args() -> dict[str, Any]:
    """configs/local.yaml's application args as shipped (what `make run` serves)."""
    return yaml.safe_load(LOCAL_CONFIG.read_text())["applications"][0]["args"]


def demo_token_id(text: str) -> int:
    """The demo model's token id for ``text`` (a whole vocabulary entry)."""
    from tokenizers import Tokenizer

    from replicas.demo_model import build_demo_model

    return Tokenizer.from_file(str(build_demo_model() / "tokenizer.json")).token_to_id(text)


def engine_processes(workers: bool = True) -> list[psutil.Process]:
    """Live vLLM engine processes on this machine: every EngineCore and, with
    ``workers``, their Worker processes (what must not outlive a stack)."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue  # exited (holds no memory), not reaped yet
            text = (proc.info["name"] or "") + " " + " ".join(proc.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        # vLLM titles its processes VLLM::EngineCore_DP0, VLLM::Worker_TP0, ...
        if ("EngineCore" in text or (workers and "VLLM::Worker" in text)) and proc.pid != os.getpid():
            found.append(proc)
    return found


def replica_engine_processes(model: str | None = None) -> list[psutil.Process]:
    """EngineCore processes started by Serve replicas (not by a bare `vllm serve`),
    only those of ``model``'s replicas when given."""
    from contract.model_config import deployment_name

    # A replica's title names its application and deployment: ServeReplica:<app>:<deployment>
    # (the main application's, or the model's direct route's).
    marker = re.compile("ServeReplica:" + (f"[^:]+:{re.escape(deployment_name(model))}(?![\\w-])" if model else ""))

    def under_replica(proc: psutil.Process) -> bool:
        try:
            return any(marker.search(p.name() + " ".join(p.cmdline())) for p in proc.parents())
        except psutil.Error:
            return False

    return [proc for proc in engine_processes(workers=False) if under_replica(proc)]


def haproxy_processes() -> list[psutil.Process]:
    """Live haproxy processes (Ray Serve's HAProxy ingress): none may outlive its
    stack, or it keeps the stack's port (cluster/haproxy_guard.py)."""
    return [
        p
        for p in psutil.process_iter(["name", "status"])
        if (p.info["name"] or "") == "haproxy" and p.info["status"] != psutil.STATUS_ZOMBIE
    ]


def edge_server_states(backend: str) -> dict[str, str]:
    """HAProxy's state of each server of ``backend`` (``show stat``: UP, DOWN, MAINT,
    ...), asked on this node's HAProxy admin socket. A server HAProxy holds down takes
    no request, whatever the edge router picks: HAProxy then balances."""
    return {name: row["status"] for name, row in edge_server_stats(backend).items()}


def edge_server_stats(backend: str) -> dict[str, dict[str, str]]:
    """HAProxy's statistics of each server of ``backend`` (``show stat``'s row: ``status``,
    ``stot``: the requests it was sent, ...) since HAProxy's last reload."""
    import csv
    import io
    import socket

    import ray
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_SOCKET_PATH

    folder, name = os.path.split(RAY_SERVE_HAPROXY_SOCKET_PATH)
    # This node's (a test connected to Ray); else the newest: the one stack this box runs
    # (`llmctl run`'s; earlier stacks' sockets stay behind).
    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "*"
    path = max(glob.glob(os.path.join(folder, node, name)), key=os.path.getmtime)
    with socket.socket(socket.AF_UNIX) as admin:
        admin.settimeout(5)
        admin.connect(path)
        admin.sendall(b"show stat\n")
        answer = b"".join(iter(lambda: admin.recv(65536), b"")).decode()
    rows = csv.DictReader(io.StringIO(answer.removeprefix("# ")))
    return {row["svname"]: row for row in rows if row["pxname"] == backend}


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
    from ray import serve

    from serve_app.app import build_app, build_direct_app, direct_apps

    # The previous module's Ray may still be exiting (a CI run's ray.init timed out
    # waiting for its raylet 2 s after the chaos module's `ray stop --force`).
    wait_for_no_ray()
    start_ray(
        include_dashboard=dashboard,
        log_to_driver=False,
        logging_level="WARNING",
        _system_config=ray_system_config or {},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
        for direct in direct_apps(args):  # models with direct_route: an application each
            serve.run(
                build_direct_app(direct["args"]),
                name=direct["name"],
                route_prefix=direct["route_prefix"],
                blocking=False,
            )
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_serve_and_ray()


def stop_serve_and_ray() -> None:
    """This process' Ray, with Serve in it; then wait until no vLLM engine is left.

    Not `serve.shutdown()` first: it drains every replica one deployment after the
    other (15 s for one model, more per model) for a stack about to vanish with its
    Redis. Ending Ray kills the replicas; their engines and HAProxy die with them
    (replicas/engine_guard.py, cluster/haproxy_guard.py), which wait_for_no_engines
    checks. The graceful stop is tested where users meet it: `make stop` and Ctrl-C
    (tests/e2e/local_stack, test_chaos_e2e.py)."""
    import ray

    ray.shutdown()
    wait_for_no_engines()
    deadline = time.monotonic() + 30
    while haproxy_processes():
        assert time.monotonic() < deadline, f"HAProxy outlived its stack: {haproxy_processes()}"
        time.sleep(0.5)


# `make stop` ends the stack within this (serve_app/ops/local_stack.py STOP_BOUND_S).
STACK_STOP_S = 30
BIN = Path(sys.executable).parent


def start_ray(**options) -> None:
    """``ray.init(**options)``, once more if its start fails. A raylet that timed out
    starting (a CI run, a second after the previous module's Ray had ended) left the
    GCS and the other head processes of that start behind, and every later module
    failed on "another Ray instance"; so a failed start is stopped before the retry
    (and before raising). Only this start's processes run then: wait_for_no_ray()
    came first."""
    import ray

    for attempt in (1, 2):
        try:
            ray.init(**options)
            return
        except Exception:
            ray.shutdown()
            stop_every_ray()
            wait_for_no_ray()
            if attempt == 2:
                raise


def stop_every_ray() -> None:
    """`ray stop --force`: every Ray process on this machine ends."""
    subprocess.run([str(BIN / "ray"), "stop", "--force"], capture_output=True, timeout=120)


def ray_processes() -> list[psutil.Process]:
    """Live raylet and GCS processes on this machine (zombies hold nothing)."""
    return [
        p
        for p in psutil.process_iter(["name", "status"])
        if (p.info["name"] or "") in ("raylet", "gcs_server") and p.info["status"] != psutil.STATUS_ZOMBIE
    ]


def wait_for_no_ray(timeout_s: float = 30) -> None:
    """Until no raylet or GCS runs here: the previous module's Ray may still be exiting."""
    deadline = time.monotonic() + timeout_s
    while ray_processes():
        assert time.monotonic() < deadline, "another Ray instance runs on this machine"
        time.sleep(0.5)


def assert_no_other_stack() -> None:
    """Modules that stop Ray the operator's way (`ray stop --force` ends every
    Ray process on the machine) run only alone."""
    wait_for_no_ray()
    assert not engine_processes(), "vLLM engine processes are already running"


def llmctl_status(redis_url: str) -> dict[str, Any] | None:
    """What `llmctl status --json` shows of the running stack (an operator's view); None
    when it cannot say (the stack between two states)."""
    import json

    shown = subprocess.run(
        [str(BIN / "llmctl"), "status", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "REDIS_URL": redis_url},
    )
    return json.loads(shown.stdout) if shown.returncode == 0 else None


class CliStack:
    """The stack as `make run` starts it: `llmctl run` of a Serve config, in a
    session of its own (as a terminal's foreground job), with its own Ray."""

    def __init__(self, config: dict, redis_url: str, workdir: Path):
        self.port = config["http_options"]["port"]
        self.config = workdir / "config.yaml"
        self.config.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "stack.log"  # what `make run` shows in its terminal
        self.serve_log_path = workdir / "serve.log"  # Ray's and vLLM's output
        self.redis_url = redis_url
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.log_path, "a")
        # A session of its own, as a terminal's foreground job would be.
        self.proc = subprocess.Popen(
            [str(BIN / "llmctl"), "run", str(self.config), "--log", str(self.serve_log_path)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "REDIS_URL": self.redis_url},
        )
        log.close()

    def wait_ready(self, timeout_s: float = 800) -> None:
        """Until the terminal shows the ready block (every model answered a request).
        The bound is the shipped, compiled config's first start in a fresh checkout
        (cold torch.compile cache) on a loaded 2-core box: 195 s in one CI run, 402 s
        in another (under the 900 s per-test limit)."""
        deadline = time.monotonic() + timeout_s
        while "Ready after" not in self.log_path.read_text():
            assert self.proc.poll() is None, self.log_tail()
            assert time.monotonic() < deadline, self.log_tail()
            time.sleep(0.2)

    def wait_serving(self, secret: str, timeout_s: float = 300) -> float:
        """Seconds until a chat completion succeeds."""
        started = time.monotonic()
        while not self.serves(secret):
            assert self.proc is None or self.proc.poll() is None, f"llmctl run exited: {self.log_tail()}"
            assert time.monotonic() - started < timeout_s, f"the stack did not serve: {self.log_tail()}"
            time.sleep(1)
        return time.monotonic() - started

    def serves(self, secret: str) -> bool:
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        try:
            return (
                httpx.post(
                    self.base_url + "/v1/chat/completions",
                    json=body,
                    timeout=30,
                    headers={"authorization": f"Bearer {secret}"},
                ).status_code
                == 200
            )
        except httpx.HTTPError:
            return False

    def log_tail(self) -> str:
        serve_log = self.serve_log_path.read_text()[-3000:] if self.serve_log_path.exists() else ""
        return f"{self.log_path.read_text()[-1000:]}\n--- serve log ---\n{serve_log}"

    def kill(self) -> None:
        """Teardown whatever happened: nothing of this stack may reach the next module."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STACK_STOP_S + 10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if ray_processes():
            stop_every_ray()
        for leftover in engine_processes() + haproxy_processes():
            leftover.kill()


def wait_until_ready(base_url: str, timeout_s: float = 300) -> None:
    """Until the stack's ``/ready`` answers 200 (every model kept up has a replica that answered)."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(base_url + "/ready", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the stack never became ready"
        time.sleep(0.5)


def create_key(redis_url: str, name: str, **limits) -> tuple[str, str]:
    """Create an API key in the stack's Redis; return (key id, secret)."""
    from serve_app.identity.keys import KeyStore
    from serve_app.limits import KeyLimits
    from serve_app.redis_store.redis_client import connect

    async def create():
        client = connect(redis_url)
        try:
            record, secret = await KeyStore(client).create(name, KeyLimits(**limits))
            return record.id, secret
        finally:
            await client.aclose()

    return asyncio.run(create())


def create_key_of_disabled_team(redis_url: str, name: str) -> str:
    """The secret of a new key whose team (also new, also ``name``) is disabled, made in
    the stack's Redis through the admin operations (the admin API may be under test)."""
    from serve_app.admin import operations as admin
    from serve_app.admin.operations import AdminStores
    from serve_app.redis_store.redis_client import connect

    async def create() -> str:
        client = connect(redis_url)
        try:
            stores = AdminStores.over(client)
            team = await admin.create_team(stores, {"name": name}, "test")
            key = await admin.create_key(stores, {"name": name, "team": team["id"]}, "test")
            await admin.revoke_team(stores, team["id"], "test")
            return key["secret"]
        finally:
            await client.aclose()

    return asyncio.run(create())


def create_team_key(redis_url: str, team_name: str, key_name: str, **team_fields) -> tuple[str, str, str]:
    """A key in team ``team_name`` (made with ``team_fields``, e.g. ``cache_isolation``,
    if it is not there yet), through the admin operations: (team id, key id, secret)."""
    from serve_app.admin import operations as admin
    from serve_app.admin.operations import AdminStores
    from serve_app.redis_store.redis_client import connect

    async def create() -> tuple[str, str, str]:
        client = connect(redis_url)
        try:
            stores = AdminStores.over(client)
            teams = {team.name: team for team in await stores.teams.list()}
            if team_name in teams:
                team_id = teams[team_name].id
            else:
                team_id = (await admin.create_team(stores, {"name": team_name, **team_fields}, "test"))["id"]
            key = await admin.create_key(stores, {"name": key_name, "team": team_id}, "test")
            return team_id, key["id"], key["secret"]
        finally:
            await client.aclose()

    return asyncio.run(create())


def cache_salt(redis_url: str, tenant: str, client_salt: str | None = None) -> str | None:
    """The engine cache salt the gateway gives requests of ``tenant`` ("key:<id>",
    "team:<id>", "" shared): what the routers hash with their prompts
    (serve_app/identity/cache_isolation.py), read from the stack's secret."""
    from serve_app.identity.cache_isolation import CacheSalts, salt_for
    from serve_app.redis_store.redis_client import connect

    async def secret() -> bytes:
        client = connect(redis_url)
        try:
            return await CacheSalts(client).secret()
        finally:
            await client.aclose()

    return salt_for(asyncio.run(secret()), tenant, client_salt)


def model_app(model_name: str) -> str:
    """The Serve application that runs ``model_name``'s deployment: its direct route's
    (``direct-<model>``) when it has one, else the main application."""
    from ray import serve

    from contract.model_config import deployment_name

    wanted = deployment_name(model_name)
    holders = [name for name, app in serve.status().applications.items() if wanted in app.deployments]
    assert len(holders) == 1, f"deployment {wanted!r} runs in {holders or 'no application'}"
    return holders[0]


def call_replica(model_name: str, method: str, *args, app_name: str | None = None):
    """Call a model replica's method from (synchronous) test code; ``app_name``:
    the application that runs it (by default the one found by ``model_app``).

    Handles are made and awaited on one long-lived event loop: with Ray
    Serve's throughput mode the router runs on the caller's loop, not on a
    thread of its own, and Serve caches handles (with their loop).
    """
    from ray import serve

    from contract.model_config import deployment_name

    app = app_name or model_app(model_name)

    async def call():
        handle = serve.get_deployment_handle(deployment_name(model_name), app_name=app)
        return await getattr(handle, method).remote(*args)

    return asyncio.run_coroutine_threadsafe(call(), _driver_loop()).result(timeout=60)


_loop: asyncio.AbstractEventLoop | None = None


def _driver_loop() -> asyncio.AbstractEventLoop:
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
        threading.Thread(target=_loop.run_forever, name="test-driver-loop", daemon=True).start()
    return _loop
