"""The vLLM plugin that asks Linux for the AMX tile state (replicas/cpu_amx.py).

Without it, an eager vLLM CPU engine on an AMX machine dies with SIGILL at its
first attention call (reproduced on this box: worker exit code -4)."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Linux x86-64: arch_prctl is syscall 158; ARCH_GET_XCOMP_PERM reports the
# extended states this process may use, bit 18 being AMX tile data.
PERMISSION_CHECK = textwrap.dedent("""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    def amx_granted():
        mask = ctypes.c_uint64(0)
        assert libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0, ctypes.get_errno()
        return bool(mask.value >> 18 & 1)

    import torch
    before = amx_granted()
    from replicas.cpu_amx import register
    register()
    print(before, amx_granted())
""")


def amx_cpu() -> bool:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    return "amx_tile" in Path("/proc/cpuinfo").read_text()


def test_the_amx_request_is_a_vllm_general_plugin():
    plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    if "llm_cluster_cpu_amx" not in plugins:
        pytest.fail("reinstall the project (make setup): the vllm.general_plugins entry point is missing")
    assert plugins["llm_cluster_cpu_amx"] == "replicas.cpu_amx:register"


@pytest.mark.skipif(not amx_cpu(), reason="needs an x86-64 Linux CPU with AMX")
def test_a_process_may_use_amx_tiles_after_the_plugin_ran():
    done = subprocess.run(
        [sys.executable, "-c", PERMISSION_CHECK], capture_output=True, text=True, cwd=REPO, timeout=120, check=True
    )
    before, after = done.stdout.split()
    assert before == "False"  # importing torch alone does not ask: the bug's cause
    assert after == "True"
