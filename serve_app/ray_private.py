"""Everything the gateway uses of Ray that Ray has not made public, in one room.

Each entry names what it reaches and why no public API does it, read against Ray 2.60.0
(``ray[serve]`` as pyproject.toml pins it). Nothing else of the gateway imports a
``ray.*._private`` module or touches a ``_``-name of a Ray object
(tests/unit/test_boundaries.py checks both), so a Ray upgrade that moves one of these
breaks here alone, under a name that says what was lost. (The local twin's node
provider has its own: cluster/ray_private.py.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # typed as it is; at run time imported when first asked for (``__getattr__``)
    from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

RAY_VERSION_READ = "2.60.0"


def __getattr__(name: str) -> Any:
    """``PowerOfTwoChoicesRequestRouter`` (Serve's power-of-two router, which its public
    ``ray.serve.request_router`` does not export), imported when first asked for: this
    module is imported by every process of the gateway (telemetry.py), and importing
    Serve's router package costs seconds, and imports Ray, which ``llmctl status`` must
    configure first (serve_app/ops/status.py)."""
    if name == "PowerOfTwoChoicesRequestRouter":
        from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter as router

        return router
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "RAY_VERSION_READ",
    "PowerOfTwoChoicesRequestRouter",
    "chosen_replica",
    "choose_replica_unreserved",
    "haproxy_enabled",
    "metrics_report_interval_s",
    "record_counter",
    "serve_controller_client",
    "unary_assigned",
    "assigned_call",
    "with_ingress_request_router",
]


def haproxy_enabled() -> bool:
    """Whether Serve runs HAProxy as its HTTP ingress (``RAY_SERVE_ENABLE_HA_PROXY``, as
    Serve read it: ``ray.serve._private.constants``)."""
    from ray.serve._private.constants import RAY_SERVE_ENABLE_HA_PROXY

    return bool(RAY_SERVE_ENABLE_HA_PROXY)


async def unary_assigned(response: Any) -> None:
    """Until a ``DeploymentResponse`` is assigned a replica (``_fetch_future_result_async``):
    its public ``await`` also waits for the answer, and the gateway bounds the queue wait
    alone (pipeline/replica_calls.py)."""
    await response._fetch_future_result_async()


def assigned_call(response: Any) -> Any:
    """The replica call a ``DeploymentResponse`` (or response generator) was assigned
    (``response._replica_result``, None before ``unary_assigned``): the object Serve
    hands its request router's ``on_request_routed``, by which the router says which
    replica took it (serve_app/routing/outliers.py ``taken_by``). No public API names
    the replica of a call that failed without an answer."""
    return getattr(response, "_replica_result", None)


def choose_replica_unreserved(handle: Any, *args: Any) -> Any:
    """``handle.choose_replica(*args)`` without a slot reserved on the replica
    (``_reserve=False``): the edge router only picks; HAProxy sends the request."""
    return handle.choose_replica(*args, _reserve=False)


def chosen_replica(selection: Any) -> Any:
    """The running replica a ``choose_replica`` selection holds (``selection._replica``):
    its HTTP endpoint and full id, which the selection does not expose."""
    return selection._replica


def with_ingress_request_router(app: Any, router: Any) -> Any:
    """``app`` with ``router`` as its ingress request router
    (``Application._with_ingress_request_router``, what Ray Serve LLM uses itself)."""
    return app._with_ingress_request_router(router)


def record_counter(counter: Any, value: float, tags: dict[str, str] | None) -> None:
    """Record ``value`` on a Ray ``Counter`` (``Counter._record``, what ``inc`` calls):
    ``inc`` refuses 0, and a series exported at 0 is what a dashboard's rate needs."""
    counter._record(value, tags=tags)


def metrics_report_interval_s() -> float:
    """Ray's metrics export interval (``ray._config.metrics_report_interval_ms``); raises
    outside a Ray worker."""
    import ray

    return ray._config.metrics_report_interval_ms() / 1000


def serve_controller_client() -> Any:
    """Serve's controller client of this driver (``serve.context._get_global_client``), or
    None: its ``get_serve_details`` is the controller's full view, with the target
    replica counts ``serve.status()`` lacks."""
    from ray import serve

    return serve.context._get_global_client()


def init_handle(handle: Any) -> None:
    """Start a ``DeploymentHandle``'s router now (``handle._init``), not at its first
    request: the edge router's first pick then has the replicas in hand."""
    handle._init()


# Serve's ``RequestRouter`` state a router of ours reads (serve_app/routing/serve_routers.py).


def router_deployment_name(router: Any) -> str:
    """The deployment a request router routes for (``router._deployment_id``)."""
    return router._deployment_id.name


def replicas_holding(router: Any, adapter: str) -> set[str]:
    """The unique ids of the replicas that hold the multiplexed model ``adapter``, as
    Serve's router learned them (``router._multiplexed_model_id_to_replica_ids``)."""
    return {rid.unique_id for rid in router._multiplexed_model_id_to_replica_ids.get(adapter, ())}


def cached_queue_len(router: Any, replica: Any) -> int | None:
    """Serve's cached count of ``replica``'s requests, None when it has none or the
    cache is off (``router._use_replica_queue_len_cache``, ``_replica_queue_len_cache``)."""
    if not router._use_replica_queue_len_cache:
        return None
    return router._replica_queue_len_cache.get(replica.replica_id)


async def probe_queue_lens(router: Any, replicas: list[Any]) -> list[tuple[Any, int | None]]:
    """Ask each of ``replicas`` its count now (``router._probe_queue_lens``, which also
    refreshes Serve's cache): (replica, count or None)."""
    return await router._probe_queue_lens(replicas, 0)
