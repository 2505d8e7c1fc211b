"""A model's autoscaling settings, as operators write them in the config, and the
names the replicas and the policy share.

Turned into Ray Serve's ``autoscaling_config`` with this project's LLM-aware
policy (``autoscale.serve_policy.LLMAutoscalingPolicy``, named by its import path so
this module imports nothing of Ray) plugged in. The policy owns the up/down delays,
so Serve's own delays are set to zero: two timers in series would double every delay
and reset each other. The policy's own defaults (``autoscale.policy.ScalingConfig``)
are these (tests/unit/test_autoscale_wiring.py checks they agree).
"""

from __future__ import annotations

from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

POLICY_IMPORT_PATH = "autoscale.serve_policy:LLMAutoscalingPolicy"

# What each replica reports to Serve's controller (record_autoscaling_stats) and the policy reads.
ENGINE_WAITING = "engine_waiting_requests"  # requests in the engine's scheduler queue
KV_CACHE_USAGE = "kv_cache_usage"  # 0..1


class _DEFAULTS:
    """LLM defaults: a replica runs many sequences at once (continuous batching),
    starts slowly (weights, KV cache), and drains long streams."""

    min_replicas = 1
    max_replicas = 4
    target_ongoing_requests = 16.0  # per replica, in the engine's batch
    waiting_per_replica = 2.0  # engine queue a replica may carry before it counts as saturated
    kv_cache_high = 0.85
    kv_cache_low = 0.50
    upscale_delay_s = 15.0
    downscale_delay_s = 120.0


class AutoscalingSettings(BaseModel):
    """Defaults suit an LLM replica: many sequences per replica (continuous
    batching), slow starts (weights + KV cache), long streams to drain."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(
        _DEFAULTS.min_replicas, ge=0, description="0 = scale to zero when idle (requests then wait for a cold start)."
    )
    max_replicas: int = Field(_DEFAULTS.max_replicas, ge=1, description="Replicas at most, however busy.")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at deploy time; default min_replicas.")
    target_ongoing_requests: float = Field(
        _DEFAULTS.target_ongoing_requests, gt=0, description="Requests per replica the engine batches comfortably."
    )
    waiting_per_replica: float = Field(
        _DEFAULTS.waiting_per_replica,
        ge=0,
        description="Engine queue per replica above which the model counts as saturated (scale up).",
    )
    kv_cache_high: float = Field(
        _DEFAULTS.kv_cache_high, gt=0, le=1, description="KV-cache use that counts as saturated."
    )
    kv_cache_low: float = Field(
        _DEFAULTS.kv_cache_low, ge=0, le=1, description="KV-cache use below which shrinking is allowed."
    )
    upscale_delay_s: float = Field(
        _DEFAULTS.upscale_delay_s, ge=0, description="How long a wish for more replicas must last."
    )
    downscale_delay_s: float = Field(
        _DEFAULTS.downscale_delay_s, ge=0, description="How long a wish for fewer must last; one replica per delay."
    )
    look_back_period_s: float = Field(
        10.0, gt=0, description="Window Serve averages replica metrics over (its default, 30 s, reacts slowly)."
    )

    @model_validator(mode="after")
    def _bounds(self) -> Self:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must lie between min_replicas and max_replicas")
        if self.kv_cache_low > self.kv_cache_high:
            raise ValueError("kv_cache_low must not exceed kv_cache_high")
        return self

    @property
    def scales_to_zero(self) -> bool:
        return self.min_replicas == 0

    def policy_kwargs(self) -> dict[str, float]:
        """What the policy needs beyond Serve's bounds (JSON, as Serve requires)."""
        return {
            "target_ongoing_requests": self.target_ongoing_requests,
            "waiting_per_replica": self.waiting_per_replica,
            "kv_cache_high": self.kv_cache_high,
            "kv_cache_low": self.kv_cache_low,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
        }

    def serve_autoscaling_config(self) -> dict[str, Any]:
        """Ray Serve's ``autoscaling_config`` for the model's deployment."""
        config: dict[str, Any] = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "look_back_period_s": self.look_back_period_s,
            # The policy applies the delays itself (see module docstring).
            "upscale_delay_s": 0,
            "downscale_delay_s": 0,
            "policy": {"policy_function": POLICY_IMPORT_PATH, "policy_kwargs": self.policy_kwargs()},
        }
        if self.initial_replicas is not None:
            config["initial_replicas"] = self.initial_replicas
        return config
