"""vLLM's own processes die with the process that started them.

A replica runs vLLM's engine in child processes (the EngineCore, and on some
platforms worker processes under it). They ignore SIGTERM and, when their
replica ends without shutting the engine down politely (``ray stop --force``,
raylet or node death), they can be left running, reparented, holding gigabytes
of memory (and on a GPU node the device's memory).

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes
(pyproject.toml registers ``register`` below). In a process that vLLM started
through ``multiprocessing`` (not in the replica itself), it:

- asks Linux to SIGKILL the process when its parent dies (``PR_SET_PDEATHSIG``),
  which cascades: the replica dies -> its EngineCore -> the EngineCore's workers;
- exits at once if the parent is already gone (it died before the request
  took effect);
- where the signal is not available (not Linux), watches the parent from a
  daemon thread and exits when it changes.

Setting ``VLLM_PLUGINS`` to a list without ``llm_cluster_engine_guard`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 1.0


def register() -> None:
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return  # not started by vLLM: the replica itself, or a CLI
    guard(parent.pid)


def guard(parent_pid: int) -> None:
    """Die when ``parent_pid`` (this process's parent) dies."""
    if not _set_parent_death_signal(signal.SIGKILL):
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()
    if os.getppid() != parent_pid:  # it died before the signal was armed
        os._exit(1)


def _set_parent_death_signal(signum: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(WATCH_INTERVAL_S)
    os._exit(1)
