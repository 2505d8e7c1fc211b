"""Per-model settings: what to serve, how vLLM runs it, and how Serve places it.

Importing this module is cheap (no vLLM, no torch): the ingress builds the
application from these objects on the CPU head node.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEMO_SOURCE = "demo"


class ModelConfig(BaseModel):
    """One served model. Several of these make a cluster's config."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Served model name: the `model` clients send.")
    source: str = Field(
        DEMO_SOURCE,
        description="Local path or hub id of the weights; 'demo' builds the tiny local model.",
    )
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
        options.update(self.deployment)
        return options


def deployment_name(model_name: str) -> str:
    """Serve deployment name for a model (Serve names may not contain '/')."""
    return "model-" + model_name.replace("/", "--")
