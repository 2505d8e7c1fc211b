"""The ingress deployment: OpenAI's HTTP API in front of the model replicas.

It maps each route to an operation (chat, completions, embeddings) and lets the
``Gateway`` admit it, send it to the model's replica deployment through a
``DeploymentHandle`` and relay the answer: JSON as one body, streams chunk by
chunk. It holds no model state.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from fastapi import Request
from ray import serve
from redis.exceptions import RedisError
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import UploadFile
from starlette.responses import FileResponse, JSONResponse, Response

from contract.model_config import deployment_name, direct_app_name
from contract.replica_wire import Usage
from serve_app.admin import operations as admin
from serve_app.admission.access import Access
from serve_app.admission.scripts import Refusal
from serve_app.identity.jwt_auth import is_jwt_identity
from serve_app.wire.api_requests import list_params, parse_json_object
from serve_app.stored import responses_api
from serve_app.dialects import anthropic, azure, databricks, sagemaker
from serve_app.stored.batch_runner import BatchRunner
from serve_app.stored.batches import BatchStore
from serve_app.wire.calls import Call
from serve_app.errors import OpenAIError
from serve_app.stored.files_api import PURPOSES, FileStore, safe_filename, storage_full
from serve_app.pipeline.gateway import Gateway
from serve_app.pipeline.refusals import render as render_refusal
from serve_app.identity.keys import KeyRecord
from serve_app.http.console import Console
from serve_app.http.readiness import Readiness
from serve_app.http.request_handling import HandlesRequests, as_call, openai_app, serve_request_id
from serve_app.settings import AppSettings
from serve_app.stored.stored_responses import ResponseStore, item_list, stored_space
from serve_app.telemetry import Telemetry
from serve_app.stored.upload_form import read_upload_form

logger = logging.getLogger("ray.serve")

app = openai_app("llm-cluster")


# Who may call each route, declared with the route itself (``route`` below). "probe":
# anyone (liveness/readiness; names no model); "key": an API key, and only for models
# the key may use (a model's data, its card included, never reaches another key);
# "admin": the admin token. Every route the app serves is declared so
# (tests/unit/test_route_access.py), and tests/e2e/shared_stack/test_security_e2e.py
# calls each "key" route for a model the key may not use.
# Who may call a route: probes anyone, "key" an API key (or identity token), "admin" an
# admin credential, "console" the operator console's session (an admin credential at
# /console/login: serve_app/http/console.py).
Access_ = Literal["probe", "key", "admin", "console"]
ROUTE_ACCESS: dict[tuple[str, str], Access_] = {}


def route(method: str, path: str, access: Access_):
    """``app``'s route for ``method`` and ``path``, with who may call it."""
    ROUTE_ACCESS[(method, path)] = access
    return getattr(app, method.lower())(path)


# (Helpers above the class: @serve.deployment pickles the class when it is defined.)
@serve.deployment
@serve.ingress(app)
class Ingress(HandlesRequests):
    """The route table. Each route authenticates, reads the body and hands a
    canonical OpenAI request to the ``Gateway``; dialect routes translate on
    the way in and out (``serve_app/dialects/``)."""

    def __init__(self, settings: AppSettings, models: dict[str, DeploymentHandle]):
        self.settings = settings
        self.max_body_bytes = settings.ingress.max_body_bytes
        self.body_timeout_s = settings.ingress.body_timeout_s
        self.telemetry = Telemetry(settings.telemetry.per_key_metrics, settings.telemetry.access_log,
                                   settings.telemetry.per_key_max_keys)
        # A model with direct_route lives in its own application (serve_app/http/direct.py).
        models = {**models, **{
            model.name: DeploymentHandle(deployment_name(model.name), direct_app_name(model.name))
            for model in settings.models if model.direct_route
        }}
        deployments = {name: handle.deployment_name for name, handle in models.items()}
        self.telemetry.models_served(deployments)
        self.telemetry.keep_gauges_fresh()  # Serve runs __init__ on the replica's event loop
        self.access = Access(settings, self.telemetry)
        self.console = Console(self.access)
        self.access.start_maintenance()  # lease renewal, settlements Redis missed
        describers = {name: DeploymentHandle(handle.deployment_name, handle.app_name) for name, handle in models.items()}
        self.gateway = Gateway(self.access, models, settings.models, self.telemetry, describers)
        stored = stored_space(self.access.redis, settings.store.max_bytes_per_key, settings.store.max_objects_per_key)
        self.responses = ResponseStore(self.access.redis, stored)
        batch = settings.batch
        self.files = FileStore(self.access.redis, batch.files_dir, batch.max_file_bytes, batch.max_bytes_per_key,
                               batch.max_files_per_key)
        self.batches = BatchStore(self.access.redis, self.files, batch.max_requests, batch.max_active_per_key,
                                  max_line_bytes=self.max_body_bytes, records=stored)
        self.batch_runner = BatchRunner(self.batches, self.files, self.gateway, self.access, self.telemetry, batch)
        self.batch_runner.start()  # takes batches from Redis: any ingress replica runs any key's batch
        self.readiness = Readiness(settings.models, deployments, self.gateway.catalog.described,
                                   {model.name: direct_app_name(model.name) for model in settings.models
                                    if model.direct_route})

    # -- OpenAI API (also under OpenVINO Model Server's /v3 and Databricks'
    #    /serving-endpoints, where the OpenAI client is pointed at them) ---------

    @route("POST", "/v1/chat/completions", "key")
    @route("POST", "/v3/chat/completions", "key")
    @route("POST", "/serving-endpoints/chat/completions", "key")
    async def chat_completions(self, request: Request) -> Response:
        return await self._openai("chat", request)

    @route("POST", "/v1/completions", "key")
    @route("POST", "/v3/completions", "key")
    @route("POST", "/serving-endpoints/completions", "key")
    async def completions(self, request: Request) -> Response:
        return await self._openai("completions", request)

    @route("POST", "/v1/embeddings", "key")
    @route("POST", "/v3/embeddings", "key")
    @route("POST", "/serving-endpoints/embeddings", "key")
    async def embeddings(self, request: Request) -> Response:
        return await self._openai("embeddings", request)

    # -- OpenAI's Responses API (state in Redis: serve_app/stored/responses_api.py) -------

    @route("POST", "/v1/responses", "key")
    async def create_response(self, request: Request) -> Response:
        return await self._handle("openai", request, lambda body, key: responses_api.translate(
            body, key, self.responses))

    @route("GET", "/v1/responses/{response_id}", "key")
    async def retrieve_response(self, response_id: str, request: Request) -> Response:
        async def retrieve(key: KeyRecord) -> dict[str, Any]:
            return (await responses_api.retrieve(self.responses, key, response_id))["response"]

        return await self._stored(request, retrieve)

    @route("DELETE", "/v1/responses/{response_id}", "key")
    async def delete_response(self, response_id: str, request: Request) -> Response:
        return await self._stored(request, lambda key: responses_api.delete(self.responses, key, response_id))

    @route("GET", "/v1/responses/{response_id}/input_items", "key")
    async def response_input_items(self, response_id: str, request: Request) -> Response:
        params = list_params(request.query_params)

        async def items(key: KeyRecord) -> dict[str, Any]:
            stored = await responses_api.retrieve(self.responses, key, response_id)
            return item_list(stored["input_items"], **params)

        return await self._stored(request, items)

    # -- OpenAI's Files and Batch API (state in Redis and the files directory:
    #    serve_app/stored/files_api.py, batches.py; run by serve_app/stored/batch_runner.py) ------

    async def _stored(self, request: Request, work) -> Response:
        """``work(key)`` for the caller's key, admitted like any request of it
        (requests/min and a concurrency slot, no tokens: an upload holds its slot
        while it is read); Redis unreachable is a 503."""
        key = await self.access.authenticate(request.headers)
        ticket = await self.access.admit(key, "", 0, serve_request_id(request))
        if isinstance(ticket, Refusal):
            raise render_refusal(ticket)
        try:
            answer = await work(key)
        except RedisError:
            self.access.settle(ticket, "failed", Usage())
            raise OpenAIError(503, "Files, batches and stored responses are unavailable right now. Please retry "
                                   "shortly.", code="store_unavailable",
                              headers={**ticket.headers, "retry-after": "1"}) from None
        except OpenAIError as exc:
            self.access.settle(ticket, "failed", Usage())
            exc.headers = {**ticket.headers, **exc.headers}
            raise
        except BaseException:
            self.access.settle(ticket, "failed", Usage())
            raise
        self.access.settle(ticket, "completed", Usage())
        response = answer if isinstance(answer, Response) else JSONResponse(answer)
        response.headers.update(ticket.headers)
        return response

    @route("POST", "/v1/files", "key")
    async def create_file(self, request: Request) -> Response:
        async def upload(key: KeyRecord) -> dict[str, Any]:
            declared = request.headers.get("content-length", "")
            if not declared.isdigit():
                raise OpenAIError(411, "Send the upload with a Content-Length.", code="length_required")
            if int(declared) > self.files.max_bytes + 64 * 1024:  # the file plus its form's few fields
                raise OpenAIError(413, f"The file is larger than {self.files.max_bytes} bytes.", param="file",
                                  code="file_too_large")
            # The key's room first (no byte read, not even into the form's spool
            # file, for a key whose files are at their bound), then the form.
            async with self.files.reservation(key.id, int(declared)) as file_id:
                try:
                    form = await read_upload_form(request, max_files=1, max_fields=4)
                except OSError:  # the form's spool file (the temp directory) could not be written
                    raise storage_full() from None
                except Exception as exc:  # starlette's MultiPartException, or a body that is no form
                    raise OpenAIError(400, f"Send the file as multipart/form-data with 'file' and 'purpose' ({exc}).",
                                      param="file") from None
                try:
                    purpose, file = form.get("purpose"), form.get("file")
                    if purpose not in PURPOSES:
                        raise OpenAIError(400, f"Invalid 'purpose': {purpose!r}; this server stores files for "
                                               f"{', '.join(PURPOSES)}.", param="purpose", code="invalid_value")
                    if not isinstance(file, UploadFile):
                        raise OpenAIError(400, "Missing required parameter: 'file'.", param="file",
                                          code="missing_required_parameter")
                    return await self.files.upload(key.id, file_id, safe_filename(file.filename), purpose,
                                                   file.file)
                finally:
                    await form.close()

        return await self._stored(request, upload)

    @route("GET", "/v1/files", "key")
    async def list_files(self, request: Request) -> Response:
        params = list_params(request.query_params, default_limit=10_000, max_limit=10_000)
        return await self._stored(request, lambda key: self.files.page(
            key.id, request.query_params.get("purpose"), **params))

    @route("GET", "/v1/files/{file_id}", "key")
    async def retrieve_file(self, file_id: str, request: Request) -> Response:
        return await self._stored(request, lambda key: self.files.get(key.id, file_id))

    @route("DELETE", "/v1/files/{file_id}", "key")
    async def delete_file(self, file_id: str, request: Request) -> Response:
        return await self._stored(request, lambda key: self.files.delete(key.id, file_id))

    @route("GET", "/v1/files/{file_id}/content", "key")
    async def file_content(self, file_id: str, request: Request) -> Response:
        async def content(key: KeyRecord) -> Response:
            record = await self.files.get(key.id, file_id)
            return FileResponse(self.files.path(key.id, file_id), media_type="application/jsonl",
                                filename=record["filename"])

        return await self._stored(request, content)

    @route("POST", "/v1/batches", "key")
    async def create_batch(self, request: Request) -> Response:
        async def create(key: KeyRecord) -> dict[str, Any]:
            if is_jwt_identity(key.id):
                # Its runner reads the key again before each request; a token's user is
                # in no store to read (and its token expires long before 24 h).
                raise OpenAIError(403, "Batches need an API key: an identity token cannot run a batch.",
                                  code="batch_needs_api_key")
            return await self.batches.create(key.id, parse_json_object(await self._read_body(request)))

        return await self._stored(request, create)

    @route("GET", "/v1/batches", "key")
    async def list_batches(self, request: Request) -> Response:
        params = list_params(request.query_params)
        return await self._stored(request, lambda key: self.batches.page(key.id, params["limit"], params["after"]))

    @route("GET", "/v1/batches/{batch_id}", "key")
    async def retrieve_batch(self, batch_id: str, request: Request) -> Response:
        return await self._stored(request, lambda key: self.batches.get(key.id, batch_id))

    @route("POST", "/v1/batches/{batch_id}/cancel", "key")
    async def cancel_batch(self, batch_id: str, request: Request) -> Response:
        return await self._stored(request, lambda key: self.batches.cancel(key.id, batch_id))

    # -- Anthropic's Messages API (route label "anthropic") ------------------------

    @route("POST", "/v1/messages", "key")
    async def anthropic_messages(self, request: Request) -> Response:
        return await self._handle("anthropic", request, as_call("messages"), anthropic.error_response)

    @route("POST", "/v1/messages/count_tokens", "key")
    async def anthropic_count_tokens(self, request: Request) -> Response:
        return await self._handle("anthropic", request, as_call("count_tokens"), anthropic.error_response)

    # -- vLLM's own endpoints (route label "vllm"): scoring, reranking (Jina's and
    #    Cohere's v2 shape), the tokenizer ----------------------------------------

    @route("POST", "/score", "key")
    @route("POST", "/v1/score", "key")
    async def score(self, request: Request) -> Response:
        return await self._handle("vllm", request, as_call("score"))

    @route("POST", "/rerank", "key")
    @route("POST", "/v1/rerank", "key")
    @route("POST", "/v2/rerank", "key")
    async def rerank(self, request: Request) -> Response:
        return await self._handle("vllm", request, as_call("rerank"))

    @route("POST", "/tokenize", "key")
    async def tokenize(self, request: Request) -> Response:
        return await self._handle("vllm", request, as_call("tokenize"))

    @route("POST", "/detokenize", "key")
    async def detokenize(self, request: Request) -> Response:
        return await self._handle("vllm", request, as_call("detokenize"))

    @route("GET", "/v1/models", "key")
    @route("GET", "/v3/models", "key")
    async def list_models(self, request: Request) -> JSONResponse:
        key = await self.access.tenant(request.headers)
        return JSONResponse({"object": "list", "data": await self.gateway.catalog.model_cards(key)})

    @route("GET", "/v1/models/{model_id:path}", "key")
    @route("GET", "/v3/models/{model_id:path}", "key")
    async def retrieve_model(self, model_id: str, request: Request) -> JSONResponse:
        key = await self.access.tenant(request.headers)
        return JSONResponse(await self.gateway.catalog.seen_by(key).model_card(model_id))

    # -- Azure AI model inference -------------------------------------------------

    async def _azure(self, operation: str, request: Request) -> Response:
        async def translate(body: dict[str, Any], key: KeyRecord) -> Call:
            return await azure.translate(operation, body, request.headers, self.gateway.catalog.seen_by(key))

        return await self._handle("azure", request, translate, on_error=azure.error_response)

    @route("POST", "/chat/completions", "key")
    @route("POST", "/models/chat/completions", "key")
    async def azure_chat_completions(self, request: Request) -> Response:
        return await self._azure("chat", request)

    @route("POST", "/embeddings", "key")
    @route("POST", "/models/embeddings", "key")
    async def azure_embeddings(self, request: Request) -> Response:
        return await self._azure("embeddings", request)

    @route("GET", "/info", "key")
    @route("GET", "/models/info", "key")
    async def azure_info(self, request: Request) -> Response:
        try:
            key = await self.access.tenant(request.headers)
            return await azure.info(key, request.headers, self.gateway.catalog.seen_by(key))
        except OpenAIError as exc:
            return azure.error_response(exc)

    # -- SageMaker LMI ----------------------------------------------------------------

    @route("POST", "/invocations", "key")
    async def sagemaker_invocations(self, request: Request) -> Response:
        return await self._handle("sagemaker", request, lambda body, key: sagemaker.translate(body, self.gateway.catalog.seen_by(key)))

    @route("GET", "/ping", "probe")
    async def sagemaker_ping(self) -> Response:
        # SageMaker sends traffic once /ping is 200: its readiness check.
        return await self.ready()

    # -- Databricks -------------------------------------------------------------------

    @route("POST", "/serving-endpoints/{name}/invocations", "key")
    async def databricks_invocations(self, name: str, request: Request) -> Response:
        return await self._handle("databricks", request, lambda body, key: databricks.translate(name, body, self.gateway.catalog.seen_by(key)))

    # -- admin API (same operations as `llmctl`) ---------------------------------

    async def _admin_json(self, request: Request) -> tuple[str, Any]:
        """(the admin calling, the request's JSON object)."""
        actor = await self.access.admin_actor(request.headers)
        raw = await self._read_body(request)
        return actor, parse_json_object(raw) if raw else {}

    @route("POST", "/admin/keys", "admin")
    async def admin_create_key(self, request: Request) -> JSONResponse:
        actor, body = await self._admin_json(request)
        return JSONResponse(await admin.create_key(self.access, body, actor), status_code=201)

    @route("GET", "/admin/keys", "admin")
    async def admin_list_keys(self, request: Request) -> JSONResponse:
        await self.access.admin_actor(request.headers)
        return JSONResponse(await admin.list_keys(self.access))

    @route("GET", "/admin/keys/{key}", "admin")
    async def admin_show_key(self, key: str, request: Request) -> JSONResponse:
        await self.access.admin_actor(request.headers)
        return JSONResponse(await admin.show_key(self.access, key))

    @route("PATCH", "/admin/keys/{key}", "admin")
    async def admin_update_key(self, key: str, request: Request) -> JSONResponse:
        actor, body = await self._admin_json(request)
        return JSONResponse(await admin.update_key(self.access, key, body, actor))

    @route("DELETE", "/admin/keys/{key}", "admin")
    async def admin_revoke_key(self, key: str, request: Request) -> JSONResponse:
        actor = await self.access.admin_actor(request.headers)
        return JSONResponse(await admin.revoke_key(self.access, key, actor))

    @route("GET", "/admin/keys/{key}/usage", "admin")
    async def admin_key_usage(self, key: str, request: Request) -> JSONResponse:
        await self.access.admin_actor(request.headers)
        return JSONResponse(await admin.usage(self.access, key))

    @route("POST", "/admin/teams", "admin")
    async def admin_create_team(self, request: Request) -> JSONResponse:
        actor, body = await self._admin_json(request)
        return JSONResponse(await admin.create_team(self.access, body, actor), status_code=201)

    @route("GET", "/admin/teams", "admin")
    async def admin_list_teams(self, request: Request) -> JSONResponse:
        await self.access.admin_actor(request.headers)
        return JSONResponse(await admin.list_teams(self.access))

    @route("GET", "/admin/teams/{team}", "admin")
    async def admin_show_team(self, team: str, request: Request) -> JSONResponse:
        await self.access.admin_actor(request.headers)
        return JSONResponse(await admin.show_team(self.access, team))

    @route("PATCH", "/admin/teams/{team}", "admin")
    async def admin_update_team(self, team: str, request: Request) -> JSONResponse:
        actor, body = await self._admin_json(request)
        return JSONResponse(await admin.update_team(self.access, team, body, actor))

    @route("DELETE", "/admin/teams/{team}", "admin")
    async def admin_revoke_team(self, team: str, request: Request) -> JSONResponse:
        actor = await self.access.admin_actor(request.headers)
        return JSONResponse(await admin.revoke_team(self.access, team, actor))

    # -- the operator console (server-rendered pages: serve_app/http/console.py) --

    @route("GET", "/console", "console")
    async def console_page(self, request: Request) -> Response:
        return await self.console.page(request)

    @route("POST", "/console/login", "console")
    async def console_login(self, request: Request) -> Response:
        return await self.console.login(request)

    @route("POST", "/console/logout", "console")
    async def console_logout(self, request: Request) -> Response:
        return await self.console.logout(request)

    @route("POST", "/console/teams", "console")
    async def console_create_team(self, request: Request) -> Response:
        return await self.console.act(request, "team")

    @route("POST", "/console/keys", "console")
    async def console_create_key(self, request: Request) -> Response:
        return await self.console.act(request, "key")

    @route("POST", "/console/keys/{key}/revoke", "console")
    async def console_revoke_key(self, key: str, request: Request) -> Response:
        return await self.console.act(request, "revoke", key)

    @route("POST", "/console/keys/{key}/limits", "console")
    async def console_key_limits(self, key: str, request: Request) -> Response:
        return await self.console.act(request, "limits", key)

    @route("GET", "/v1/organization/usage/completions", "admin")
    async def organization_usage_completions(self, request: Request) -> JSONResponse:
        """OpenAI's organization Usage API (an admin credential, as OpenAI's needs an
        admin key): per day, by key and model (serve_app/accounting/usage_report.py)."""
        await self.access.admin_actor(request.headers)
        return JSONResponse(await admin.completions_usage(self.access, request.query_params))

    @route("GET", "/v1/organization/costs", "admin")
    async def organization_costs(self, request: Request) -> JSONResponse:
        """OpenAI's organization Costs API: per day, by key and line item ("<model>, input")."""
        await self.access.admin_actor(request.headers)
        return JSONResponse(await admin.costs(self.access, request.query_params))

    @route("GET", "/admin/requests/{request_id}", "admin")
    async def admin_request(self, request_id: str, request: Request) -> JSONResponse:
        await self.access.admin_actor(request.headers)
        return JSONResponse(await admin.request(self.access, request_id, request.query_params.get("key")))

    @route("GET", "/admin/batches", "admin")
    async def admin_list_batches(self, request: Request) -> JSONResponse:
        await self.access.admin_actor(request.headers)
        params = list_params(request.query_params)
        return JSONResponse(await admin.list_batches(self.access, self.batches, request.query_params.get("key"),
                                                     params["limit"], params["after"]))

    @route("POST", "/admin/batches/{batch_id}/cancel", "admin")
    async def admin_cancel_batch(self, batch_id: str, request: Request) -> JSONResponse:
        actor = await self.access.admin_actor(request.headers)
        return JSONResponse(await admin.cancel_batch(self.access, self.batches, batch_id, actor))

    @route("POST", "/admin/admins", "admin")
    async def admin_create_admin(self, request: Request) -> JSONResponse:
        actor, body = await self._admin_json(request)
        return JSONResponse(await admin.create_admin(self.access, body, actor), status_code=201)

    @route("GET", "/admin/admins", "admin")
    async def admin_list_admins(self, request: Request) -> JSONResponse:
        await self.access.admin_actor(request.headers)
        return JSONResponse(await admin.list_admins(self.access))

    @route("DELETE", "/admin/admins/{name}", "admin")
    async def admin_revoke_admin(self, name: str, request: Request) -> JSONResponse:
        actor = await self.access.admin_actor(request.headers)
        return JSONResponse(await admin.revoke_admin(self.access, name, actor))

    @route("GET", "/admin/audit", "admin")
    async def admin_audit(self, request: Request) -> JSONResponse:
        """Admin actions, newest first: ``limit`` (1-1000), ``before`` (an entry id: the
        next page), ``actor``, ``target`` (a key id, a batch id)."""
        await self.access.admin_actor(request.headers)
        query = request.query_params
        return JSONResponse(await admin.audit_trail(self.access, query.get("limit", 100), query.get("before"),
                                                    query.get("actor"), query.get("target")))

    # -- probes (the only routes without a key: they name no model) ----------------

    @route("GET", "/health", "probe")
    async def health(self) -> JSONResponse:
        """Liveness: the ingress process answers."""
        return JSONResponse({"status": "ok"})

    @route("GET", "/ready", "probe")
    async def ready(self) -> JSONResponse:
        """Readiness: every model kept up has a replica that answers (serve_app/http/readiness.py)."""
        is_ready, body = await self.readiness.check()
        return JSONResponse(body, status_code=200 if is_ready else 503)

