"""Application builders: ``serve run serve_app.app:build_app`` or a Serve config's
``import_path``. One replica deployment per configured model, one ingress; a
model with ``direct_route`` has its deployment in an application of its own
(``build_direct_app``), which the ingress reaches by name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ray.serve import Application

from contract.model_config import POWER_OF_TWO_ROUTER, ModelConfig, direct_app_name, direct_route_prefix
from replicas.vllm_replica import VLLMReplica
from serve_app.http.ingress import Ingress
from serve_app.ray_private import with_ingress_request_router
from serve_app.settings import AppSettings

# Any config change redeploys the ingress (it holds the settings): let the old
# replica relay its streams to their end before it exits (Serve's 20 s cuts them).
# No surge by default: with no spare capacity a surge never schedules and the
# rollout waits forever; configs give it where the cluster has room.
INGRESS_ROLLOUT_DEFAULTS = {"graceful_shutdown_timeout_s": 300}

# Ray Serve's gRPC between replicas (throughput mode) refuses a message over 4 MiB by
# default, below the request body limit (8 MiB) and below what one answer can be (an
# embeddings answer is ~8 kB per input); a refused message was a 500 charged the whole
# reservation. Every deployment of the gateway (ingress, models, direct routes) takes
# gRPC's own maximum, the one Serve gives its other gRPC servers: what crosses is
# bounded by the body limit (requests) and the input bounds (answers) instead.
TRANSPORT_ENV = {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1)}


def with_transport_env(options: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Serve ``options`` whose replicas run with ``TRANSPORT_ENV`` and ``env`` (the
    tracing variables), beside any env vars they set."""
    actor = dict(options.get("ray_actor_options") or {})
    runtime_env = dict(actor.get("runtime_env") or {})
    runtime_env["env_vars"] = {**TRANSPORT_ENV, **(env or {}), **(runtime_env.get("env_vars") or {})}
    actor["runtime_env"] = runtime_env
    return {**options, "ray_actor_options": actor}


def model_deployment(model: ModelConfig, env: dict[str, str] | None = None) -> Application:
    """One model's replica deployment, as the application deploys it."""
    return VLLMReplica.options(**with_transport_env(model.serve_options(), env)).bind(model)  # type: ignore[attr-defined]


def build_app(args: dict[str, Any] | None = None) -> Application:
    settings = AppSettings(**(args or {}))
    tracing = settings.telemetry.tracing
    models = {
        model.name: model_deployment(model, tracing.env(f"llm-model-{model.name}"))
        for model in settings.models
        if not model.direct_route  # in its own application (build_direct_app)
    }
    ingress = with_transport_env(
        {**INGRESS_ROLLOUT_DEFAULTS, **settings.ingress.deployment}, tracing.env("llm-gateway")
    )
    return Ingress.options(**ingress).bind(settings, models)  # type: ignore[attr-defined]  # a Serve Deployment


def build_direct_app(args: dict[str, Any]) -> Application:
    """The application of a model with ``direct_route``: the main application's
    ``args`` plus ``direct_model`` (its name; optional when one model has
    ``direct_route``). Deploy it as ``direct_apps(args)`` names it."""
    args = dict(args)
    name = args.pop("direct_model", None)
    settings = AppSettings(**args)
    direct = [model for model in settings.models if model.direct_route]
    chosen = [model for model in direct if model.name == name] if name else direct
    if len(chosen) != 1:
        raise ValueError(f"direct_model must name one of the models with direct_route: {[m.name for m in direct]}")
    from serve_app.http.direct import DirectModel

    model = chosen[0]
    options = with_transport_env(model.serve_options(), settings.telemetry.tracing.env(f"llm-model-{model.name}"))
    if not routes_at_the_edge(model, options):
        # HAProxy balances its replicas (Serve refuses a custom router on an application's
        # ingress without an ingress request router); the ingress' handle calls to it use
        # Serve's default router.
        options.pop("request_router_config", None)
        return DirectModel.options(**options).bind(model, settings)
    from serve_app.http.edge_router import edge_router

    app = DirectModel.options(**options).bind(model, settings)
    return with_ingress_request_router(app, edge_router(app, model, settings))


def routes_at_the_edge(model: ModelConfig, options: dict[str, Any]) -> bool:
    """Whether ``model``'s direct application (with these Serve ``options``) has its
    replica chosen by the model's request router at the edge
    (serve_app/http/edge_router.py): it may run more than one replica, the edge is
    HAProxy (Ray's ingress request routers need it), and its policy asks for affinity
    or it serves LoRA adapters (a replica that holds the adapter is preferred: Serve's
    multiplexing, in every router)."""
    from serve_app.ray_private import haproxy_enabled

    router = (options.get("request_router_config") or {}).get("request_router_class")
    autoscaling = options.get("autoscaling_config") or {}
    most = autoscaling.get("max_replicas", 1) if autoscaling else options.get("num_replicas", 1)
    affinity = router not in (None, POWER_OF_TWO_ROUTER) or model.lora is not None
    return haproxy_enabled() and affinity and most != 1


def direct_apps(args: dict[str, Any]) -> list[dict[str, Any]]:
    """The Serve config entries (name, route_prefix, import_path, args) of the
    direct routes ``args`` (the main application's) asks for."""
    settings = AppSettings(**args)
    return [
        {
            "name": direct_app_name(model.name),
            "route_prefix": direct_route_prefix(model.name),
            "import_path": "serve_app.app:build_direct_app",
            "args": {**args, "direct_model": model.name},
        }
        for model in settings.models
        if model.direct_route
    ]


def _direct_apps_asked(serve_config: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """Each ``build_app`` application of ``serve_config`` with each direct route's
    entry its args ask for (``direct_apps``)."""
    for main in serve_config.get("applications", []):
        if main.get("import_path") == "serve_app.app:build_app":
            for expected in direct_apps(main.get("args") or {}):
                yield main, expected


def direct_route_problems(serve_config: dict[str, Any]) -> list[str]:
    """What ``serve deploy`` of ``serve_config`` as it stands would get wrong about its
    direct routes (`llmctl check-config` refuses it): a model with ``direct_route`` whose
    application is not declared (its deployment would not exist: the ingress' calls to it
    fail and the edge has no route for it), or one declared other than ``direct_apps``
    has it (args other than its main application's plus ``direct_model``: the model
    would run with settings the ingress does not know)."""
    declared = {app.get("name"): app for app in serve_config.get("applications", [])}
    problems = []
    for main, expected in _direct_apps_asked(serve_config):
        args_of_main = f"the args of application {main.get('name')!r} plus direct_model"
        name, model = expected["name"], expected["args"]["direct_model"]
        found = declared.get(name)
        if found is None:
            problems.append(
                f"application {name!r} is missing: model {model!r} has direct_route and is served by it alone "
                f"(declare it with route_prefix {expected['route_prefix']}, import_path "
                f"{expected['import_path']}, args: {args_of_main}; configs/gpu.yaml does it with a YAML anchor)"
            )
            continue
        for field in ("route_prefix", "import_path", "args"):
            if found.get(field) != expected[field]:
                wanted = args_of_main if field == "args" else repr(expected[field])
                problems.append(f"application {name!r}: {field} must be {wanted}")
    return problems


def with_direct_apps(serve_config: dict[str, Any]) -> dict[str, Any]:
    """``serve_config`` plus the application of each direct route its
    ``build_app`` applications ask for and it does not declare yet (`llmctl run`)."""
    declared = {app.get("name") for app in serve_config.get("applications", [])}
    added = [direct for _, direct in _direct_apps_asked(serve_config) if direct["name"] not in declared]
    return {**serve_config, "applications": [*serve_config.get("applications", []), *added]} if added else serve_config
