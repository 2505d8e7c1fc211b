"""Which replica of a direct route takes a request, chosen at the edge with the prompt in hand.

A direct route's requests (``/direct/<model>/v1/...``, and ``/v1`` through the edge's
one hop) go from HAProxy straight to one of the model's replicas. Left to HAProxy,
that is the replica with the fewest connections: no prefix or cache affinity. When the
model's ``routing.policy`` asks for affinity and it may run more than one replica, its
application gets this deployment as Ray's *ingress request router*
(``Application._with_ingress_request_router``, what Ray Serve LLM's direct streaming
uses for its one model): for each POST, HAProxy's Lua hands the body it has read
(``RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY``) to ``/internal/route`` here and
sends the request to the replica this answers. The choice is the model's own request
router's (serve_app/routing/serve_routers.py: the same class the ingress' handle calls use,
with the same load guard, session ids and index; for a LoRA adapter, among the replicas
that hold it, as Serve's multiplexing has them), asked through Serve's
``choose_replica`` without a reservation: the request itself goes over HAProxy, so only
the pick is wanted. The tokens still cross one process boundary after the engine.

What this costs: one HTTP call from HAProxy to this deployment per request (it runs
beside HAProxy, ``num_cpus=0``), before the request goes out. A model with one replica
and no autoscaling has nothing to choose and keeps HAProxy's own balancing.

The prompt is placed as the replica's gateway will run it: salted with its tenant's
cache salt (serve_app/identity/cache_isolation.py), from the credential HAProxy forwards
with the body (cluster/haproxy_edge.py ``edge_router_lua``), so a tenant's request goes
where its own cache is and never where another tenant's is; a session header or a
``prompt_cache_key`` is a session of its tenant's (hashed with the salt, as the gateway
hashes it). A credential that does not authenticate here (the replica will refuse it)
is routed unsalted and without a session. A body the router cannot read (not JSON,
past HAProxy's buffer) has no prompt: the router then balances by load, as for a
request without one. Anything that fails here
is HAProxy's 503 "Ingress request router failed" (the client retries), never a request
sent nowhere.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from contract.edge import MAX_SESSION_ID_CHARS, session_header
from contract.model_config import ModelConfig
from contract.prompt_blocks import prompt_text
from serve_app.errors import OpenAIError
from serve_app.http.body_bounds import bounded_route
from serve_app.http.services import build_edge_tenancy
from serve_app.identity.cache_isolation import put_salt
from serve_app.ray_private import choose_replica_unreserved, chosen_replica, init_handle
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry

router_app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
# HAProxy's asks (a body it read whole, at most its buffer): bounded as every route's is.
router_app.router.route_class = bounded_route("json")

# What the model's request router reads as the call's operation (args[0]); the body is
# args[1], as on the ingress' handle calls (replica_calls.py).
ROUTE_OPERATION = "route"


def routing_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object, or {} when it is none (then nothing is gained by affinity)."""
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError):
        return {}
    return body if isinstance(body, dict) else {}


@serve.ingress(router_app)
class EdgeRouter:
    """Answers HAProxy's ``/internal/route``: ``{"host", "port", "replica_id"}`` of the
    replica the model's request router picks for this body and session."""

    def __init__(self, model: DeploymentHandle, config: ModelConfig, settings: AppSettings):
        self._model = model
        self._config = config
        init_handle(self._model)  # the handle's router starts now, not on the first request
        self._session_header = session_header()
        self._tenancy = build_edge_tenancy(settings, Telemetry(False, False))

    @router_app.post("/internal/route")
    async def route(self, request: Request) -> dict[str, Any]:
        body = routing_body(await request.body())
        routing: dict[str, Any] = {}
        header = request.headers.get(self._session_header, "")[:MAX_SESSION_ID_CHARS] or None
        if (header or prompt_text(body, 1)) and (session := await self._isolate(body, request, header)):
            routing["session_id"] = session
        if isinstance(body.get("model"), str) and (adapter := self._config.adapter_named(body["model"])):
            routing["multiplexed_model_id"] = adapter  # as the gateway names it (pipeline/gateway.py)
        handle = self._model.options(**routing) if routing else self._model
        try:
            async with choose_replica_unreserved(handle, ROUTE_OPERATION, body) as selection:
                replica = chosen_replica(selection)
                endpoint = replica.backend_http_endpoint
                if endpoint is None:
                    raise HTTPException(503, f"replica {selection.replica_id} has no HTTP endpoint")
                host, port = endpoint
                return {"host": host, "port": port, "replica_id": replica.replica_id.to_full_id_str()}
        except DeploymentUnavailableError as exc:
            raise HTTPException(503, str(exc)) from None

    async def _isolate(self, body: dict[str, Any], request: Request, header: str | None) -> str | None:
        """Salts ``body`` as the replica's gateway will (its tenant's cache); the routing
        session its session ``header`` or ``prompt_cache_key`` names within its tenant, or
        None. Unsalted and without a session when the caller is not known here."""
        try:
            key = await self._tenancy.authenticator.authenticate(request.headers)
            team = await self._tenancy.authenticator.team_of(key, self._config.name)
            return await self._tenancy.salts.isolate(body, key, team, self._config, header)
        except OpenAIError:  # refused, or Redis away: the replica answers it
            put_salt(body, None)
            return None

    @router_app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}


def edge_router_name(model_name: str) -> str:
    return "edge-router-" + model_name.replace("/", "--")


# How long the router trusts a replica's count of running requests before asking it
# again (Serve's default: 10 s). Its picks are never sent through Serve, which would
# count them and their end: between asks, the count is the last answer plus the picks
# made since (``ChosenNotSent``, routing.py), so a request that ended still counts until
# the next ask. Asking every 0.1 s costs each replica ten small calls a second.
QUEUE_LENGTH_REFRESH_S = "0.1"


def edge_router(model_app, config: ModelConfig, settings: AppSettings) -> Any:
    """The ingress request router of the direct application ``model_app`` (the bound
    deployment of the model ``config``), named after the model (``llmctl status`` lists
    every direct application's deployments side by side)."""
    # max_ongoing_requests: every request of the model asks it first; Serve's default (5) would queue them.
    env = {"RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S": QUEUE_LENGTH_REFRESH_S}
    return serve.deployment(  # type: ignore[attr-defined]  # given the class, a Deployment
        EdgeRouter,
        name=edge_router_name(config.name),
        max_ongoing_requests=1000,
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": env}},
    ).bind(model_app, config, settings)
