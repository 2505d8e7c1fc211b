"""The Ray Serve environments the benchmarks start targets with (one place, so
that "as shipped" means what the Makefile exports)."""

from __future__ import annotations

import sys
from pathlib import Path

# Ray Serve settings as the Makefile exports them (what `make run` runs with):
# HAProxy ingress (through the guard, when installed) and throughput mode.
HAPROXY_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
_GUARD = Path(sys.executable).with_name("llm-haproxy")
GUARD_ENV = {"RAY_SERVE_HAPROXY_BINARY_PATH": str(_GUARD)} if _GUARD.exists() else {}
MAKEFILE_ENV = {
    **HAPROXY_ENV,
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5",
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
    "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE": "262144",
    **GUARD_ENV,
}
# The previous default: Ray's Python proxy in place of HAProxy.
RAY_PROXY_ENV = {**MAKEFILE_ENV, "RAY_SERVE_ENABLE_HA_PROXY": "0"}
# Ray Serve LLM's defaults: nothing of ours may leak into its run.
RAY_DEFAULT_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0",
    "RAY_SERVE_ENABLE_HA_PROXY": "0",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "0",
}
# Its HAProxy through the guard too: Ray's own, once reloaded, can outlive a polite
# `serve run` stop and keep ports 8404/9101, so the next target's HAProxy cannot start
# (seen in a 3-repeat run). The guard only exits it with its parent; it is not in the path.
RSLLM_FAST_ENV = {**HAPROXY_ENV, "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1", **GUARD_ENV}
