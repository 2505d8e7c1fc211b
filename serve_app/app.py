"""Application builder: ``serve run serve_app.app:build_app`` or a Serve config's
``import_path``. One replica deployment per configured model, one ingress."""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from replicas.vllm_replica import VLLMReplica
from serve_app.ingress import Ingress
from serve_app.settings import AppSettings


# Any config change redeploys the ingress (it holds the settings): let the old
# replica relay its streams to their end before it exits (Serve's 20 s cuts them).
# No surge by default: with no spare capacity a surge never schedules and the
# rollout waits forever; configs give it where the cluster has room.
INGRESS_ROLLOUT_DEFAULTS = {"graceful_shutdown_timeout_s": 300}


def build_app(args: dict[str, Any] | None = None) -> Application:
    settings = AppSettings(**(args or {}))
    models = {
        model.name: VLLMReplica.options(**model.serve_options()).bind(model)
        for model in settings.models
    }
    return Ingress.options(**{**INGRESS_ROLLOUT_DEFAULTS, **settings.ingress.deployment}).bind(settings, models)

