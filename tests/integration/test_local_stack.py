"""How `llmctl run` stops a stack, on real processes shaped like one: a
session leader that ignores Ctrl-C's SIGINT (as `serve run` draining for 300 s
would), children that ignore SIGTERM (as vLLM's engines do), one of them
reparented away from the tree (as a Ray process whose parent died first).
The whole stack, under Ray and vLLM: tests/e2e/local_stack/."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import psutil
import yaml

from serve_app.ops import local_stack

# A stubborn stack: leader → child → grandchild, and an orphan (its parent exits
# at once) still in the leader's session. Every one ignores SIGINT and SIGTERM.
STUBBORN = textwrap.dedent("""
    import signal, subprocess, sys, time
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    role = sys.argv[1]
    spawn = lambda r: subprocess.Popen([sys.executable, __file__, r])
    if role == "leader":
        spawn("child")
        spawn("orphan-parent").wait()
    elif role == "child":
        spawn("grandchild")
    elif role == "orphan-parent":
        spawn("orphan")
        sys.exit(0)
    time.sleep(600)
""")


@contextlib.contextmanager
def stubborn_stack(tmp_path) -> Iterator[tuple[subprocess.Popen, list[psutil.Process]]]:
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    leader = subprocess.Popen([sys.executable, str(script), "leader"], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            session = [
                p
                for p in psutil.process_iter(["cmdline"])
                if _sid(p.pid) == leader.pid
                and p.info["cmdline"]
                and p.info["cmdline"][-1] in ("leader", "child", "grandchild", "orphan")
            ]
            orphan = [p for p in session if p.info["cmdline"][-1] == "orphan"]
            if len(session) == 4 and orphan[0].ppid() != _pid_of(session, "leader") and _reparented(orphan[0]):
                break
            assert time.monotonic() < deadline, session
            time.sleep(0.1)
        yield leader, session
    finally:
        for proc in psutil.process_iter():
            if _sid(proc.pid) == leader.pid:
                proc.kill()
        leader.wait()


def _pid_of(session: list[psutil.Process], role: str) -> int:
    return next(p.pid for p in session if p.info["cmdline"][-1] == role)


def _reparented(proc: psutil.Process) -> bool:
    """Its parent (orphan-parent) has exited."""
    try:
        return psutil.Process(proc.ppid()).cmdline()[-1:] != ["orphan-parent"]
    except psutil.Error:
        return False


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def test_stop_kills_a_stubborn_stack_after_its_grace(tmp_path):
    with stubborn_stack(tmp_path) as (leader, session):
        tree = {p.pid for p in psutil.Process(leader.pid).children(recursive=True)}
        orphan = next(p for p in session if p.info["cmdline"][-1] == "orphan")
        assert orphan.pid not in tree  # only the session finds it
        took = local_stack.stop(leader, grace_s=1.0)
        assert 1.0 <= took < local_stack.STOP_BOUND_S
        assert leader.poll() is not None
        alive = [p for p in session if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, alive


def test_a_second_signal_skips_the_grace(tmp_path):
    with stubborn_stack(tmp_path) as (leader, _):
        took = local_stack.stop(leader, grace_s=60, hurry=lambda: True)
        assert took < 5


def test_stop_without_a_running_stack_is_a_no_op(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLM_CLUSTER_DATA_DIR", str(tmp_path))
    assert local_stack.request_stop() == 0
    local_stack.pid_file().write_text(f"{os.getpid()}\n")  # a live pid that is not `llmctl run`
    assert local_stack.running_stack_pid() is None
    assert local_stack.request_stop() == 0
    assert "no local stack is running" in capsys.readouterr().err


def test_stop_returns_once_the_stack_ended_even_if_nobody_reaped_it(tmp_path, monkeypatch):
    # `llmctl run` started by a parent that has not waited for it yet stays a
    # zombie after it ended; `llmctl stop` must not wait for the reaping.
    monkeypatch.setenv("LLM_CLUSTER_DATA_DIR", str(tmp_path))
    fake = tmp_path / "llmctl"
    fake.write_text("import time\ntime.sleep(600)\n")
    run = subprocess.Popen([sys.executable, str(fake), "run"])  # SIGTERM ends it; this test reaps it late
    try:
        local_stack.pid_file().write_text(f"{run.pid}\n")
        deadline = time.monotonic() + 10
        while local_stack.running_stack_pid() != run.pid:  # its cmdline is readable once exec'd
            assert time.monotonic() < deadline
            time.sleep(0.05)
        started = time.monotonic()
        assert local_stack.request_stop(timeout_s=20) == 0
        assert time.monotonic() - started < 5
        assert psutil.Process(run.pid).status() == psutil.STATUS_ZOMBIE
    finally:
        run.kill()
        run.wait()


def _config_on(tmp_path, port: int):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"http_options": {"host": "0.0.0.0", "port": port}, "applications": []}))
    return path


def test_run_refuses_a_port_another_program_listens_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLM_CLUSTER_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(local_stack.subprocess, "Popen", None)  # nothing may start
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]
        assert local_stack.run(_config_on(tmp_path, port)) == 1
    err = capsys.readouterr().err
    assert f"port {port} on 0.0.0.0 is taken by another program" in err and "http_options.port" in err
    assert not local_stack.pid_file().exists()
    # Once it is gone, the port counts as free (what the stack binds next).
    assert not local_stack.port_in_use("0.0.0.0", port)


def test_the_banner_outlasts_a_port_that_answers_in_something_other_than_http(tmp_path, capsys):
    # What a Ray replica's gRPC server answers an HTTP/1.1 request with: an HTTP/2
    # SETTINGS frame. The banner says so and waits on; it never ends `llmctl run`.
    with socket.create_server(("127.0.0.1", 0)) as grpc_like:

        def answer():
            conn, _ = grpc_like.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x05\x00\x00\x40\x00")

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        banner = local_stack.ReadyBanner(_config_on(tmp_path, grpc_like.getsockname()[1]), None)
        banner._polled = banner._reported = banner.started - 60  # due for a poll and a progress line
        banner.poll()
        thread.join(timeout=10)
    out = capsys.readouterr().out
    assert "answers, but not in HTTP (BadStatusLine): is another program on that port?" in out
    assert not banner.shown
