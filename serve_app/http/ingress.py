"""The ingress deployment: OpenAI's HTTP API (and the dialects, stored objects, the
admin API and the console) in front of the model replicas.

Its routes are declared by surface in serve_app/http/routes/, each with who may call it
(serve_app/http/route_access.py enforces it); this class wires what they use: the quota
services and the ``Gateway`` (one builder, serve_app/http/services.py), the stores of
Responses, Files and Batches, the batch runner, the console and readiness. The gateway
admits each request, sends it to the model's replica deployment through a
``DeploymentHandle`` and relays the answer: JSON as one body, streams chunk by chunk. It
holds no model state.
"""

from __future__ import annotations

import logging

from ray import serve
from ray.serve.handle import DeploymentHandle

from contract.model_config import deployment_name, direct_app_name
from serve_app.http.body_bounds import body_bounds_of
from serve_app.http.console import Console
from serve_app.http.readiness import Readiness
from serve_app.http.routes.admin import AdminRoutes
from serve_app.http.routes.console import ConsoleRoutes
from serve_app.http.routes.dialects import DialectRoutes
from serve_app.http.routes.openai import OpenAIRoutes
from serve_app.http.routes.probes import ProbeRoutes
from serve_app.http.routes.stored import StoredRoutes
from serve_app.http.routes.table import ROUTE_ACCESS, app
from serve_app.http.services import build_gateway
from serve_app.settings import AppSettings
from serve_app.stored.batch_runner import BatchRunner
from serve_app.stored.batches import BatchStore
from serve_app.stored.files_api import FileStore
from serve_app.stored.stored_responses import ResponseStore, stored_space
from serve_app.telemetry import Telemetry

logger = logging.getLogger("ray.serve")

__all__ = ["ROUTE_ACCESS", "Ingress", "app"]


@serve.deployment
@serve.ingress(app)
class Ingress(OpenAIRoutes, StoredRoutes, DialectRoutes, AdminRoutes, ConsoleRoutes, ProbeRoutes):
    """Every route of the ingress (its surfaces' mixins) over one set of services."""

    def __init__(self, settings: AppSettings, models: dict[str, DeploymentHandle]):
        self.settings = settings
        self.room_check_bytes = settings.ingress.room_check_bytes
        app.state.body_bounds = body_bounds_of(settings)  # every route's, by its declaration
        self.telemetry = Telemetry(
            settings.telemetry.per_key_metrics, settings.telemetry.access_log, settings.telemetry.per_key_max_keys
        )
        # A model with direct_route lives in its own application (serve_app/http/direct.py).
        models = {
            **models,
            **{
                model.name: DeploymentHandle(deployment_name(model.name), direct_app_name(model.name))
                for model in settings.models
                if model.direct_route
            },
        }
        deployments = {name: handle.deployment_name for name, handle in models.items()}
        self.telemetry.models_served(deployments)
        self.telemetry.keep_gauges_fresh()  # Serve runs __init__ on the replica's event loop
        describers: dict[str, DeploymentHandle] = {
            name: DeploymentHandle(handle.deployment_name, handle.app_name) for name, handle in models.items()
        }
        services, self.gateway = build_gateway(settings, self.telemetry, models, settings.models, describers=describers)
        self.authenticator, self.gate, self.admin_stores = services.authenticator, services.gate, services.stores
        self.console = Console(self.authenticator, self.admin_stores)
        redis = services.redis
        stored = stored_space(redis, settings.store.max_bytes_per_key, settings.store.max_objects_per_key)
        self.responses = ResponseStore(redis, stored)
        batch = settings.batch
        self.files = FileStore(
            redis, batch.files_dir, batch.max_file_bytes, batch.max_bytes_per_key, batch.max_files_per_key
        )
        self.batches = BatchStore(
            redis,
            self.files,
            batch.max_requests,
            batch.max_active_per_key,
            max_line_bytes=settings.ingress.max_body_bytes,
            records=stored,
        )
        self.batch_runner = BatchRunner(
            self.batches, self.files, self.gateway, self.admin_stores.keys, self.telemetry, batch
        )
        self.batch_runner.start()  # takes batches from Redis: any ingress replica runs any key's batch
        self.readiness = Readiness(
            settings.models,
            deployments,
            self.gateway.catalog.described,
            {model.name: direct_app_name(model.name) for model in settings.models if model.direct_route},
        )
