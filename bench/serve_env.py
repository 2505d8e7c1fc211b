"""The Ray Serve environments the benchmarks start targets with (one place, so
that "as shipped" means what the Makefile exports)."""

from __future__ import annotations

import sys
from pathlib import Path

# Ray Serve settings as the Makefile exports them (what `make run` runs with):
# HAProxy ingress (through the guard, when installed) and throughput mode.
HAPROXY_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
_GUARD = Path(sys.executable).with_name("llm-haproxy")
MAKEFILE_ENV = {**HAPROXY_ENV, "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
                **({"RAY_SERVE_HAPROXY_BINARY_PATH": str(_GUARD)} if _GUARD.exists() else {})}
# The previous default: Ray's Python proxy in place of HAProxy.
RAY_PROXY_ENV = {**MAKEFILE_ENV, "RAY_SERVE_ENABLE_HA_PROXY": "0"}
# Ray Serve LLM's defaults: nothing of ours may leak into its run.
RAY_DEFAULT_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0", "RAY_SERVE_ENABLE_HA_PROXY": "0",
                   "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0", "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "0"}
RSLLM_FAST_ENV = {**HAPROXY_ENV, "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1"}
