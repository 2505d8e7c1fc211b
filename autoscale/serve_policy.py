"""``autoscale.policy.decide`` plugged into Ray Serve's custom autoscaling.

Serve's controller calls the policy every control-loop tick with an
``AutoscalingContext``: the replica count, ongoing requests (replicas plus
handle queues) and the custom metrics each replica returns from its
``record_autoscaling_stats`` method, averaged over ``look_back_period_s``.
The replica (``replicas/vllm_replica.py``) reports the metrics named here.
This module only translates; the decision is the pure function.
"""

from __future__ import annotations

import logging
from typing import Any

from autoscale.policy import Load, ScalingConfig, State, decide
from contract.autoscaling import ENGINE_WAITING, KV_CACHE_USAGE

logger = logging.getLogger("ray.serve")

# The custom metrics every model replica reports are named in contract/autoscaling.py.

_DIRECTION, _SINCE = "llm_direction", "llm_since"


def load_from(ctx) -> Load:
    """One tick of load: ongoing requests summed by Serve, the engines' queues
    summed and their KV-cache use averaged over the replicas that reported."""
    metrics = ctx.aggregated_metrics or {}
    waiting = metrics.get(ENGINE_WAITING, {})
    kv = metrics.get(KV_CACHE_USAGE, {})
    return Load(
        ongoing_requests=float(ctx.total_num_requests),
        waiting_requests=float(sum(waiting.values())),
        kv_cache_usage=float(sum(kv.values()) / len(kv)) if kv else 0.0,
    )


class LLMAutoscalingPolicy:
    """Serve instantiates this once per deployment with the config's
    ``policy_kwargs`` and calls it each tick; what it must remember between
    ticks goes back to Serve in the returned state."""

    def __init__(self, **policy_kwargs: Any):
        self.kwargs = policy_kwargs

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        config = ScalingConfig(
            min_replicas=ctx.capacity_adjusted_min_replicas,
            max_replicas=ctx.capacity_adjusted_max_replicas,
            **self.kwargs,
        )
        # The target, not the running count: replicas still starting count as
        # already decided, otherwise the policy would ask for them again.
        current = ctx.target_num_replicas
        state = State(ctx.policy_state.get(_DIRECTION, 0), ctx.policy_state.get(_SINCE))
        load = load_from(ctx)
        decision = decide(load, current, ctx.current_time, state, config)
        if decision.replicas < current and ctx.current_num_replicas < current:
            # Never abandon a replica that is still starting: a client told to
            # retry after a cold-start timeout would find the start cancelled
            # and wait for a new one, forever. Decide again once it runs.
            return current, {_DIRECTION: 0, _SINCE: None}
        if decision.replicas != current:
            logger.info(
                "autoscale %s: %d -> %d replicas (%s; ongoing %.1f, engine waiting %.1f, KV cache %.0f%%)",
                ctx.deployment_name,
                current,
                decision.replicas,
                decision.reason,
                load.ongoing_requests,
                load.waiting_requests,
                100 * load.kv_cache_usage,
            )
        return decision.replicas, {_DIRECTION: decision.state.direction, _SINCE: decision.state.since}
