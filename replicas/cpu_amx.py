"""vLLM's processes ask Linux for the AMX tile state before vLLM's CPU kernels use it.

On x86 CPUs with AMX, vLLM 0.32's CPU attention picks its AMX kernel for bf16
(``vllm.v1.attention.backends.cpu_attn._get_attn_isa``) but never asks Linux
for the AMX tile data state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), which a
process must do before its first AMX instruction; without it the kernel kills
the process with SIGILL. torch.compile's warm-up happens to ask (inductor's AMX
check calls ``torch.cpu._init_amx``), so compiled engines work; an engine with
``enforce_eager`` had its worker die with exit code -4 on its first request.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes
(pyproject.toml registers ``register`` below), so each asks once at start. A
CPU without AMX, or a build of torch without the call, is left as it is.
"""

from __future__ import annotations


def register() -> None:
    import torch

    if hasattr(torch.cpu, "_init_amx") and torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
