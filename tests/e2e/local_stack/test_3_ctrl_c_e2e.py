"""`make run`, then Ctrl-C: the stack ends within its bound, requests in flight
end with an error, and nothing is left: no Ray process, no vLLM engine, the port
free.

A terminal's Ctrl-C is SIGINT to its foreground process group: here `llmctl
run` (what `make run` ends in) runs in a session of its own, and the test
signals that group. (`ray stop --force` and the other faults under load:
test_chaos_e2e.py.)"""

from __future__ import annotations

import os
import signal
import socket
import time

import psutil
import pytest
from stack import STACK_STOP_S, create_key, engine_processes, ray_processes
from streaming_load import StreamingLoad

pytestmark = pytest.mark.e2e


def still_running(proc: psutil.Process) -> bool:
    """Alive and not a zombie; a process that ends while it is asked (a run saw one go
    between the two questions) is not running."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_ctrl_c_ends_the_whole_stack_within_its_bound(stack, redis_server):
    _, secret = create_key(redis_server.url, "ctrl-c")
    stack.wait_serving(secret)
    assert len(engine_processes(workers=False)) == 2  # one per model (chat + embeddings)
    members = psutil.Process(stack.proc.pid).children(recursive=True)
    load = StreamingLoad(
        stack.base_url,
        secret,
        "tiny-llama",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "extra_body": {"ignore_eos": True}},
    )
    load.add(4)
    time.sleep(3)

    pressed_at = time.monotonic()
    os.killpg(stack.proc.pid, signal.SIGINT)
    assert stack.proc.wait(timeout=STACK_STOP_S + 10) == 0, stack.log_tail()
    took = time.monotonic() - pressed_at
    assert took <= STACK_STOP_S, f"the stack took {took:.1f} s to stop"
    alive = [p for p in members if still_running(p)]
    assert not alive, alive
    assert not engine_processes() and not ray_processes()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", stack.port), timeout=1).close()
    load.stop()
    # the streams cut by the stop failed loudly; none looks complete without a finish reason
    assert load.outcomes["error"] >= 1 and set(load.outcomes) <= {"complete", "error"}, (load.outcomes, load.errors)
