"""The local development stack (`make run`, `make stop`): quick to stop, nothing left.

`serve run` alone answers Ctrl-C with `serve.shutdown()`, which drains every
replica for up to its ``graceful_shutdown_timeout_s`` (300 s, the bound a real
rollout needs), and an operator who forces it then used to find vLLM engines
left running. Here `serve run` gets a Ray instance of its own (``--address
local``: never someone else's cluster) in a session of its own. Stopping it
(Ctrl-C, SIGTERM, `llmctl stop`) gives requests in flight ``grace_s`` to
finish, then kills every process of that session and tree: the Serve CLI,
Ray's processes and the vLLM engines under them (the engines also die on their
own with their replica: replicas/engine_guard.py). Graceful drain stays what
`serve deploy` rollouts and scale-downs use on a cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

# The stack's Ray is a one-node Ray on loopback, as Ray runs on a laptop (macOS, Windows):
# with its node address 127.0.0.1, Ray binds its metrics endpoints — the metrics export
# port, which serves the gateway's per-key and per-team counts and spend, the dashboard's
# and the autoscaler's — to loopback instead of every interface. (On Linux Ray takes the
# node's network address even when told 127.0.0.1; this is its switch for one-node Rays.)
LOOPBACK_RAY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

# A stop ends every process of the stack within this many seconds (docs/operating.md, "Stopping").
STOP_BOUND_S = 30
DEFAULT_GRACE_S = 5.0


def pid_file() -> Path:
    from replicas.demo_model import data_dir

    return data_dir() / "run.pid"


def running_stack_pid() -> int | None:
    """The pid of the `llmctl run` recorded in the pid file, if it still runs."""
    try:
        pid = int(pid_file().read_text().strip())
        cmdline = " ".join(psutil.Process(pid).cmdline())
    except (OSError, ValueError, psutil.Error):
        return None
    return pid if "llmctl" in cmdline and " run" in cmdline else None


def default_log() -> Path:
    return pid_file().parent / "logs" / "run.log"


def _read_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(Path(path).read_text())


def _with_direct_apps(config: Path) -> Path:
    """``config``, or a copy beside the pid file that also declares the
    application of each model with ``direct_route`` (serve_app/app.py). A direct
    application the file declares otherwise than the main one's args say is refused
    (``ValueError``), as `llmctl check-config` refuses it."""
    import yaml

    from serve_app.app import direct_route_problems, with_direct_apps

    serve_config = _read_yaml(config)
    expanded = with_direct_apps(serve_config)
    if problems := direct_route_problems(expanded):
        raise ValueError(f"{config}: " + "; ".join(problems))
    if expanded is serve_config:
        return config
    path = pid_file().parent / "serve-config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(expanded))
    return path


def http_address(serve_config: dict) -> tuple[str, int]:
    """The host and port Ray Serve's HTTP ingress binds (its defaults where unsaid)."""
    http = serve_config.get("http_options") or {}
    return http.get("host", "127.0.0.1"), int(http.get("port", 8000))


def port_in_use(host: str, port: int) -> bool:
    """Another program listens on ``host:port``: HAProxy could not bind it, and the
    stack would start and never answer there. SO_REUSEADDR, as the servers set it, so
    a previous stack's connections in TIME_WAIT do not count."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def run(config: Path, grace_s: float = DEFAULT_GRACE_S, log: Path | None = None, verbose: bool = False) -> int:
    """Serve ``config`` until the stack ends or is told to stop; return an exit code.
    Ray's and vLLM's output go to ``log`` (default: the data dir's logs/run.log),
    or to this terminal with ``verbose``; the terminal gets the ready banner."""
    other = running_stack_pid()
    if other is not None:
        print(f"a local stack already runs (pid {other}); stop it with `make stop`", file=sys.stderr)
        return 1
    try:
        serve_config = _with_direct_apps(config)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    host, port = http_address(_read_yaml(config))
    if port_in_use(host, port):
        print(
            f"port {port} on {host} is taken by another program: stop it, or set http_options.port in {config}",
            file=sys.stderr,
        )
        return 1
    signals: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda received, _frame: signals.append(received))
    log = log or default_log()
    output = None
    if not verbose:
        log.parent.mkdir(parents=True, exist_ok=True)
        output = open(log, "w")
    serve = Path(sys.executable).parent / "serve"
    stack = subprocess.Popen(
        [str(serve), "run", "--address", "local", str(serve_config)],
        start_new_session=True,
        env={**os.environ, **LOOPBACK_RAY},
        stdout=output,
        stderr=subprocess.STDOUT if output else None,
    )
    if output is not None:
        output.close()  # the child holds it
    path = pid_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()}\n")
    ray = _RayWatch(stack.pid)
    banner = ReadyBanner(config, None if verbose else log)
    try:
        while stack.poll() is None and not signals and not ray.gone():
            banner.poll()
            time.sleep(0.2)
        if ray.lost:
            # `serve run` itself would wait forever on a Ray that is gone
            # (`ray stop --force`, a killed raylet): end what is left of it.
            print("Ray stopped under the local stack; cleaning up", file=sys.stderr, flush=True)
        if signals:
            print(f"stopping the local stack (requests in flight get {grace_s:g} s)", file=sys.stderr, flush=True)
        try:
            took = stop(stack, grace_s if signals else 0, hurry=lambda: len(signals) > 1)
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
        if signals:
            print(f"local stack stopped in {took:.1f} s", file=sys.stderr)
        return 0 if signals else (1 if ray.lost else stack.returncode)
    finally:
        if running_stack_pid() == os.getpid():
            path.unlink(missing_ok=True)


class ReadyBanner:
    """Says once, clearly, when every model of the stack answers (``/ready``),
    with what a user needs next; until then, a line of progress now and then."""

    POLL_EVERY_S = 1.0
    PROGRESS_EVERY_S = 30.0

    def __init__(self, config: Path, log: Path | None):
        serve_config = _read_yaml(config)
        host, port = http_address(serve_config)
        self.base_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        self.models = [
            m["name"] for app in serve_config.get("applications", []) for m in (app.get("args") or {}).get("models", [])
        ]
        self.log = log
        self.started = time.monotonic()
        self._polled = self._reported = self.started
        self.shown = False
        where = f"logs: {log}" if log else "VERBOSE: Ray's and vLLM's output below"
        print(
            f"starting {', '.join(self.models) or 'the stack'} ({where}); "
            "the ready banner follows once every model answers",
            flush=True,
        )

    def poll(self) -> None:
        now = time.monotonic()
        if self.shown or now - self._polled < self.POLL_EVERY_S:
            return
        self._polled = now
        status = self._ready_status()
        if status.get("status") == "ready":
            self.shown = True
            print(self.text(now - self.started), flush=True)
        elif now - self._reported >= self.PROGRESS_EVERY_S:
            self._reported = now
            if "models" in status:
                progress = f"{status['models_ready']}/{status['models']} models ready"
            else:
                progress = status.get("problem", "starting Ray Serve")
            print(f"still starting ({progress}, {now - self.started:.0f} s)", flush=True)

    def _ready_status(self) -> dict:
        import http.client
        import json
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(self.base_url + "/ready", timeout=2) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:  # 503 while starting: its body says how far
            try:
                return json.loads(exc.read())
            except ValueError:
                return {}
        except http.client.HTTPException as exc:
            # Something answers there, but not in HTTP (another program took the port):
            # the stack is not ready, and the banner is no reason to end it.
            return {
                "problem": f"{self.base_url} answers, but not in HTTP ({type(exc).__name__}): "
                "is another program on that port?"
            }
        except (OSError, ValueError):  # not listening yet
            return {}

    def text(self, took_s: float) -> str:
        from replicas.demo_model import data_dir

        key_file = data_dir() / "dev-api-key"
        key = key_file.read_text().strip() if key_file.exists() else "create one: llmctl keys create NAME"
        rule = "─" * 72
        return "\n".join(
            [
                rule,
                f"  Ready after {took_s:.0f} s: every model answers.",
                f"  URL      {self.base_url}/v1   (OpenAI SDK: base_url)",
                f"  models   {', '.join(self.models)}",
                f"  API key  {key}",
                f"  logs     {self.log or 'this terminal (VERBOSE=1)'}",
                "  stop     Ctrl-C here, or `make stop` from another shell",
                rule,
            ]
        )


class _RayWatch:
    """Notices when the Ray instance `serve run` started (its GCS server and
    raylet) goes away while `serve run` itself lives on."""

    CHECK_EVERY_S = 1.0

    def __init__(self, stack_pid: int):
        self._stack_pid = stack_pid
        self._seen: set[psutil.Process] = set()
        self._checked = 0.0
        self.lost = False

    def gone(self) -> bool:
        now = time.monotonic()
        if now - self._checked < self.CHECK_EVERY_S:
            return self.lost
        self._checked = now
        if len(self._seen) < 2:  # Ray still starting: look for both among the children
            try:
                children = psutil.Process(self._stack_pid).children(recursive=True)
            except psutil.Error:
                children = []
            for proc in children:
                try:
                    if proc.name() in ("gcs_server", "raylet"):
                        self._seen.add(proc)
                except psutil.Error:
                    continue
        self.lost = any(not _alive(proc) for proc in self._seen)
        return self.lost


def _alive(proc: psutil.Process) -> bool:
    """Running, and not a zombie: a killed process whose parent has not reaped
    it yet (psutil's wait would wait for the reaping, which may never come)
    holds nothing any more."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_ended(procs, timeout_s: float) -> list[psutil.Process]:
    """Wait until none of ``procs`` is alive; return those still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    alive = [proc for proc in procs if _alive(proc)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [proc for proc in alive if _alive(proc)]
    return alive


def stop(stack: subprocess.Popen, grace_s: float, hurry=lambda: False) -> float:
    """End ``stack`` (a `serve run` started in its own session) and everything it
    started; return the seconds it took. Raises if a process outlives STOP_BOUND_S."""
    started = time.monotonic()
    members = _members(stack.pid)
    if stack.poll() is None:
        stack.send_signal(signal.SIGINT)  # serve run: shut Serve down, draining
        while stack.poll() is None and time.monotonic() - started < grace_s and not hurry():
            members |= _members(stack.pid)
            time.sleep(0.1)
    members |= _members(stack.pid)
    if stack.poll() is None:
        stack.kill()
    for proc in members:
        try:
            proc.kill()
        except psutil.Error:
            pass
    stack.wait()
    alive = _wait_ended(members, timeout_s=max(1.0, STOP_BOUND_S - (time.monotonic() - started)))
    if alive:
        raise RuntimeError(f"processes of the local stack outlived its stop: {[p.pid for p in alive]}")
    return time.monotonic() - started


def _members(stack_pid: int) -> set[psutil.Process]:
    """Every process of the stack: its tree, and whatever of its session was
    reparented away from it (a Ray process whose parent died first)."""
    members: set[psutil.Process] = set()
    try:
        members.update(psutil.Process(stack_pid).children(recursive=True))
    except psutil.Error:
        pass
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == stack_pid and proc.pid != stack_pid:
                members.add(proc)
        except (OSError, psutil.Error):
            continue
    return members


def request_stop(timeout_s: float = STOP_BOUND_S + 10) -> int:
    """`llmctl stop`: stop the stack `llmctl run` started; wait until it ended."""
    pid = running_stack_pid()
    if pid is None:
        print("no local stack is running", file=sys.stderr)
        return 0
    proc = psutil.Process(pid)
    proc.send_signal(signal.SIGTERM)
    if _wait_ended([proc], timeout_s):
        print(f"the local stack (pid {pid}) did not stop within {timeout_s:g} s", file=sys.stderr)
        return 1
    print("local stack stopped", file=sys.stderr)
    return 0
