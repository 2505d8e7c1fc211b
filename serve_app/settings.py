"""Typed settings of the gateway application.

One object, read from the Serve config's ``args`` (``build_app``) and from
``LLM_CLUSTER_*`` environment variables; the defaults serve the local run.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from replicas.config import ModelConfig


class IngressConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(
        8 * 1024 * 1024, description="Requests larger than this get 413 before parsing."
    )
    deployment: dict[str, Any] = Field(
        default_factory=lambda: {
            "num_replicas": 1,
            "max_ongoing_requests": 256,
            "ray_actor_options": {"num_cpus": 0.25},
        },
        description="Ray Serve options of the ingress deployment.",
    )


class AppSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="LLM_CLUSTER_", env_nested_delimiter="__", extra="forbid"
    )

    models: list[ModelConfig] = Field(default_factory=lambda: [ModelConfig(name="tiny-llama")])
    ingress: IngressConfig = Field(default_factory=IngressConfig)

    @model_validator(mode="after")
    def _unique_names(self):
        names = [m.name for m in self.models]
        if len(names) != len(set(names)):
            raise ValueError(f"model names must be unique, got {names}")
        if not names:
            raise ValueError("at least one model must be configured")
        return self
