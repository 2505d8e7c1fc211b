"""What the routers use of Ray Serve that Ray has not made public, in one place.

``ray.serve.request_router`` is Serve's public router API (RequestRouter, its mixins,
PendingRequest, RunningReplica); the power-of-two router itself and the HAProxy switch
are not exported. Only this module imports ``ray.serve._private``
(tests/unit/test_boundaries.py), so a Ray upgrade that moves them breaks here alone.
"""

from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

__all__ = ["PowerOfTwoChoicesRequestRouter", "haproxy_enabled"]


def haproxy_enabled() -> bool:
    """Whether Serve runs HAProxy as its HTTP ingress (``RAY_SERVE_ENABLE_HA_PROXY``, as Serve read it)."""
    from ray.serve._private.constants import RAY_SERVE_ENABLE_HA_PROXY

    return bool(RAY_SERVE_ENABLE_HA_PROXY)
