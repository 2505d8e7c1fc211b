"""An engine process dies with the process that started it (real processes:
a parent started here spawns a child the way vLLM does, then is SIGKILLed)."""

import importlib.metadata
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from stack import REPO

PARENT = textwrap.dedent(
    """
    import multiprocessing, sys, time
    sys.path.insert(0, {repo!r})

    def child(guarded):
        if guarded:
            from replicas import engine_guard
            engine_guard.register()
        time.sleep(120)

    if __name__ == "__main__":
        process = multiprocessing.get_context("spawn").Process(target=child, args=({guarded},))
        process.start()
        print(process.pid, flush=True)
        time.sleep(120)
    """
)


def spawn_family(tmp_path, guarded: bool) -> tuple[subprocess.Popen, int]:
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(repo=str(REPO), guarded=guarded))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(1.0)  # the child has imported and armed its guard
    return parent, child


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_parent(parent: subprocess.Popen) -> None:
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)


def test_a_guarded_child_dies_with_its_parent(tmp_path):
    parent, child = spawn_family(tmp_path, guarded=True)
    assert alive(child)
    kill_parent(parent)
    deadline = time.monotonic() + 5
    while alive(child):
        assert time.monotonic() < deadline, "the guarded child outlived its parent"
        time.sleep(0.05)


def test_without_the_guard_the_child_is_orphaned(tmp_path):
    # What vLLM's processes did before: the check above can fail.
    parent, child = spawn_family(tmp_path, guarded=False)
    kill_parent(parent)
    time.sleep(1.0)
    try:
        assert alive(child)
    finally:
        psutil.Process(child).kill()


def test_the_guard_is_a_vllm_general_plugin():
    plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    if "llm_cluster_engine_guard" not in plugins:
        pytest.fail("reinstall the project (make setup): the vllm.general_plugins entry point is missing")
    assert plugins["llm_cluster_engine_guard"] == "replicas.engine_guard:register"
