"""scripts/ensure_redis.sh, the local Redis `make run` and `make bench` start: a real
redis-server, started by the real script. Its scheduling class is what keeps its
wake-ups from waiting behind a CPU engine (docs/performance.md), so the test reads
the class the kernel reports for the server and for a child it forks."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import redis
from ports import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ensure_redis.sh"
REALTIME = os.SCHED_FIFO | os.SCHED_RESET_ON_FORK


def may_use_realtime() -> bool:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except PermissionError:
        return False
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    return True


def run_script(port: int, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "REDIS_URL": f"redis://127.0.0.1:{port}/0", **env},
    )


@pytest.fixture
def start_redis(tmp_path):
    """Run the script for a free port; yield (its output, the server's pid, a client)."""
    started = []

    def start(**env):
        port = free_port()
        done = run_script(port, LLM_CLUSTER_DATA_DIR=str(tmp_path), **env)
        assert done.returncode == 0, done.stderr
        client = redis.Redis(port=port)
        started.append(client)
        pid = int((tmp_path / "redis" / f"redis-{port}.pid").read_text())
        return done.stdout, pid, client

    yield start
    for client in started:
        try:
            client.shutdown(nosave=True)
        except redis.ConnectionError:
            pass  # it is gone, as asked


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


@pytest.mark.skipif(not may_use_realtime(), reason="this user may not use the real-time class (no CAP_SYS_NICE)")
def test_the_local_redis_runs_real_time_and_its_forked_children_do_not(start_redis):
    output, pid, client = start_redis()
    assert "started" in output
    assert client.ping()
    assert os.sched_getscheduler(pid) == REALTIME
    assert os.sched_getparam(pid).sched_priority == 1  # the lowest: any other real-time task comes first

    # A BGSAVE child (tens of MB to write, so it lives long enough to be seen) must not
    # hog a core in the real-time class.
    with client.pipeline(transaction=False) as pipe:
        for n in range(200_000):
            pipe.set(f"k{n}", "x" * 200)
        pipe.execute()
    client.bgsave()
    deadline = time.monotonic() + 10
    while not (forked := children(pid)):
        assert time.monotonic() < deadline, "no BGSAVE child appeared"
        time.sleep(0.005)
    assert os.sched_getscheduler(forked[0]) == os.SCHED_OTHER


def test_redis_realtime_0_keeps_the_normal_class(start_redis):
    _, pid, client = start_redis(REDIS_REALTIME="0")
    assert client.ping()
    assert os.sched_getscheduler(pid) == os.SCHED_OTHER


def test_a_running_redis_is_left_as_it_is(start_redis):
    """A Redis already listening (the operator's) is neither restarted nor reprioritised."""
    _, pid, client = start_redis(REDIS_REALTIME="0")
    port = client.connection_pool.connection_kwargs["port"]
    done = run_script(port)
    assert done.returncode == 0 and done.stdout == ""
    assert os.sched_getscheduler(pid) == os.SCHED_OTHER
    assert client.info("server")["process_id"] == pid
