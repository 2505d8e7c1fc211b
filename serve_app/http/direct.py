"""A model's direct route: its replicas answer HTTP themselves, the gateway in-process.

Through the ingress, a streamed token crosses two process boundaries after the
engine (model replica -> ingress replica -> HTTP), each a Serve item through
Ray's core worker; the profile in docs/performance.md puts that hop at most
of the gateway's CPU. A model with ``direct_route`` also runs as its own Serve
application at ``/direct/<model>``: HAProxy forwards each request straight to
one of its replicas, which authenticates, admits, runs and settles it with the
same quota services and ``Gateway`` as the ingress (a library, not a copy: services.py), calling
its own engine in-process. The ingress reaches the same deployment through a
handle for every other route (dialects, Responses, batches, scoring).

Which replica takes a request: the model's request router, asked at the edge
(edge_router.py), when the model is routed with affinity on several replicas;
HAProxy's balancing otherwise (cluster/haproxy_edge.py). What the direct route does not
do: the fair-share queue and the priority tiers' queue shares see only this replica's
requests.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from ray import serve
from ray.serve.exceptions import RequestCancelledError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from contract.edge import EDGE_NAMES_PATH, EDGE_TIME_HEADER
from contract.model_config import ModelConfig, deployment_name, direct_app_name
from replicas.vllm_replica import VLLMReplica
from serve_app.http.body_bounds import body_bounds_of
from serve_app.http.request_handling import HandlesRequests, openai_app
from serve_app.http.route_access import Routes
from serve_app.http.services import build_gateway
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry


class _Answer:
    """A unary call on this process' replica (its model card), awaited like a ``DeploymentResponse``."""

    def __init__(self, coroutine):
        self._coroutine = coroutine

    async def _fetch_future_result_async(self) -> None:
        """In-process the replica takes the call at once (``replica_calls.reach_replica``)."""

    def cancel(self) -> None:
        self._coroutine.close()

    def __await__(self):
        return self._coroutine.__await__()


class _Stream:
    """A streaming call on this process' replica, iterated like a
    ``DeploymentResponseGenerator``."""

    def __init__(self, items):
        self._items = items

    async def _fetch_future_result_async(self) -> None:
        """In-process the replica takes the call at once."""

    def __aiter__(self):
        return self

    def __anext__(self):
        return self._items.__anext__()

    def cancel(self) -> None:
        """End the replica's generator (vLLM aborts the request), as Serve's cancel does."""
        _close_soon(self._items)


class _UnaryStream(_Stream):
    """A unary call on this process' replica (a stream of one item, ``call_streamed``),
    cancellable while its one pull is in flight, as Serve's is: ``cancel`` (a key revoked
    while it runs, ``Gateway._call_unary``) ends the pull with ``RequestCancelledError``,
    the replica's generator ending where it waits (vLLM aborts the request). A pull runs
    as a task of its own so that it can be cancelled apart from the request's (one task
    a call: a stream's items, relayed, need none)."""

    def __init__(self, items):
        super().__init__(items)
        self._pull: asyncio.Future | None = None
        self._cancelled = False

    async def __anext__(self):
        if self._cancelled:
            raise RequestCancelledError()
        self._pull = asyncio.ensure_future(self._items.__anext__())
        try:
            return await self._pull
        except asyncio.CancelledError:
            if self._cancelled and not _this_task_cancelled():
                raise RequestCancelledError() from None
            raise  # the request's own task was cancelled (its client left)
        finally:
            self._pull = None

    def cancel(self) -> None:
        self._cancelled = True
        if self._pull is not None:
            self._pull.cancel()
        else:
            _close_soon(self._items)


def _this_task_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _close_soon(items) -> None:
    try:
        asyncio.ensure_future(_close(items))
    except RuntimeError:  # no running loop: the process is ending
        pass


async def _close(items) -> None:
    try:
        await items.aclose()
    except RuntimeError:
        # A pull of its first item is in flight (a stream started before its
        # admission): cancelling that pull ends the generator instead.
        pass


class _Method:
    def __init__(self, remote):
        self.remote = remote


class InProcessReplica:
    """What ``Gateway`` uses of a ``DeploymentHandle`` (``options``, and
    ``call_streamed``/``stream``/``model_info`` ``.remote``), calling the replica object of
    this process: no Serve item, no serialisation, no hop."""

    def __init__(self, replica, adapter: str = ""):
        self._replica = replica
        self._adapter = adapter
        self.deployment_name = deployment_name(replica.config.name)

    def options(
        self, *, stream: bool | None = None, multiplexed_model_id: str | None = None, session_id: str | None = None
    ) -> InProcessReplica:
        # A session needs no placing here: the edge placed it on this replica. No adapter
        # is "" (the base model), never None: the replica reads None as "ask Serve's
        # request context", which a client's header would have set.
        return InProcessReplica(self._replica, multiplexed_model_id or self._adapter or "")

    @property
    def call_streamed(self) -> _Method:
        return _Method(
            lambda operation, body, trace=None, prompt_allowance=None, avoid=(): _UnaryStream(
                self._replica.call_streamed(
                    operation, body, self._adapter, trace=trace, prompt_allowance=prompt_allowance
                )
            )
        )

    @property
    def stream(self) -> _Method:
        return _Method(
            lambda operation, body, trace=None, prompt_allowance=None, avoid=(): _Stream(
                self._replica.stream(operation, body, self._adapter, trace=trace, prompt_allowance=prompt_allowance)
            )
        )

    @property
    def model_info(self) -> _Method:
        async def info() -> dict[str, Any]:
            return self._replica.model_info()

        return _Method(lambda: _Answer(info()))


direct_app = openai_app("llm-cluster direct route")

# The routes a direct route answers, each with who may call it (route_access.py): those
# the edge sends it from /v1 (contract/edge.py) and its model list, for a key; and, with
# no credential but never through the edge, the names the edge sends it.
direct_route = Routes(direct_app)
DIRECT_ROUTES = direct_route.access


@serve.deployment
@serve.ingress(direct_app)
class DirectModel(HandlesRequests, VLLMReplica.func_or_class):  # type: ignore[name-defined]  # Serve's Deployment
    """The model's replica (``VLLMReplica``: the ingress' handle calls work as
    before) that also answers its model's OpenAI routes over HTTP."""

    async def __init__(self, config: ModelConfig, settings: AppSettings):  # type: ignore[misc]  # Serve awaits it
        await VLLMReplica.func_or_class.__init__(self, config)  # type: ignore[attr-defined]
        self.room_check_bytes = settings.ingress.room_check_bytes
        direct_app.state.body_bounds = body_bounds_of(settings)  # every route's, by its declaration
        self.telemetry = Telemetry(
            settings.telemetry.per_key_metrics, settings.telemetry.access_log, settings.telemetry.per_key_max_keys
        )
        self.telemetry.models_served({config.name: deployment_name(config.name)})
        self.telemetry.keep_gauges_fresh()
        # Its replicas share a key's limits during a Redis outage (fail_mode open).
        services, self.gateway = build_gateway(
            settings,
            self.telemetry,
            {config.name: InProcessReplica(self)},
            [config],
            config.serve_options(),
            start_early=True,
            start_early_when_idle=settings.quota.overlap_admission_when_idle,
            # A request this replica fails before its first byte (its engine dead, draining
            # or stalled) is handed on to another replica of the model through Serve.
            elsewhere={config.name: DeploymentHandle(deployment_name(config.name), direct_app_name(config.name))},
            own_replica=self.replica,
        )
        self.authenticator = services.authenticator

    @direct_route("POST", "/v1/chat/completions", "key")
    async def chat_completions(self, request: Request) -> Response:
        return await self._openai("chat", request)

    @direct_route("POST", "/v1/completions", "key")
    async def completions(self, request: Request) -> Response:
        return await self._openai("completions", request)

    @direct_route("POST", "/v1/embeddings", "key")
    async def embeddings(self, request: Request) -> Response:
        return await self._openai("embeddings", request)

    def early_starts(self) -> dict[str, int]:
        """Streams this replica's gateway sent to the engine before their admission
        returned, by outcome (also the ``llm_gateway_early_starts`` metric)."""
        return dict(self.telemetry.early_counts)

    def refused_before_body(self) -> int:
        """Requests this replica's gateway refused before reading their body (also
        ``llm_gateway_refused_before_body_total``)."""
        return self.telemetry.refused_before_body_count

    def prompts_resized(self) -> int:
        """Prompts the replica rendered past their reservation for this replica's gateway
        (each admitted again at its real size: also ``llm_gateway_prompt_resizes_total``)."""
        return self.telemetry.resize_count

    def answered(self) -> dict[str, int]:
        """The requests this replica's gateway answered over HTTP (from /direct/<model>, or
        from /v1 through the edge's one hop), by route, since it started."""
        return dict(self.telemetry.answered_counts)

    @direct_route("GET", EDGE_NAMES_PATH, "probe")
    async def edge_names(self, request: Request) -> dict[str, list[str]]:
        """What clients may name this model by, for the edge's one hop
        (cluster/haproxy_edge.py reads it from the replica itself when it writes HAProxy's
        config). A request through the edge (HAProxy stamps each) is refused: names
        a key may not see (another tenant's adapter) are not the public's."""
        if EDGE_TIME_HEADER in request.headers:
            raise HTTPException(404)  # as any route it does not serve
        names, beginnings = self.config.client_names()
        return {"names": names, "beginnings": beginnings}

    @direct_route("GET", "/v1/models", "key")
    async def list_models(self, request: Request) -> JSONResponse:
        key = await self.authenticator.tenant(request.headers)
        return JSONResponse({"object": "list", "data": await self.gateway.catalog.model_cards(key)})
