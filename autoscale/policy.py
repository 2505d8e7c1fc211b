"""How many replicas an LLM deployment wants, from what saturates an engine.

Ongoing requests alone misjudge an LLM replica: eight short chats and eight
requests with 30k-token contexts are the same count, but the second fills the
KV cache and leaves new requests waiting in the engine's queue. This policy
decides from three signals per tick:

- ongoing requests (Ray Serve's count) against ``target_ongoing_requests``;
- the engines' waiting queue: work the engines admitted but cannot run yet;
- KV-cache use: near full means the next long request waits or preempts.

A deployment is *saturated* when the engines have a queue or the KV cache is
above ``kv_cache_high``: then it wants more replicas even if the request count
looks fine. It may shrink only when *relaxed*: no queue and KV cache below
``kv_cache_low``. Between the two it holds. Decisions must persist for
``upscale_delay_s`` / ``downscale_delay_s`` before they happen (a spike or a
flapping load does not move replicas), it scales up to the wanted count at
once but down one replica per delay (each replica drains its streams before it
stops), and a deployment at zero replicas with traffic gets one at once (scale
from zero cannot wait: requests are queued meanwhile).

A pure function of its inputs and the state it returns, so it is tested on
recorded metric sequences without a cluster (tests/unit/test_autoscale_policy.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScalingConfig:
    """LLM defaults: a replica runs many sequences at once (continuous
    batching), starts slowly (weights, KV cache), and drains long streams."""

    min_replicas: int = 1
    max_replicas: int = 4
    target_ongoing_requests: float = 16.0  # per replica, in the engine's batch
    waiting_per_replica: float = 2.0  # engine queue a replica may carry before it counts as saturated
    kv_cache_high: float = 0.85
    kv_cache_low: float = 0.50
    upscale_delay_s: float = 15.0
    downscale_delay_s: float = 120.0


@dataclass(frozen=True)
class Load:
    """One tick of metrics, summed (requests) or averaged (KV) over replicas."""

    ongoing_requests: float
    waiting_requests: float = 0.0  # engines' scheduler queue, all replicas
    kv_cache_usage: float = 0.0  # 0..1, mean over replicas


@dataclass(frozen=True)
class State:
    """What the policy remembers between ticks."""

    direction: int = 0  # +1 wants more, -1 wants fewer, 0 content
    since: float | None = None  # when that wish started


@dataclass(frozen=True)
class Decision:
    replicas: int
    wanted: int  # what the load asks for now, before delays and steps
    reason: str
    state: State = field(default_factory=State)


def wanted_replicas(load: Load, current: int, config: ScalingConfig) -> tuple[int, str]:
    """What the load asks for now, within [min, max]."""
    by_requests = math.ceil(load.ongoing_requests / config.target_ongoing_requests)
    saturated = (
        load.waiting_requests > config.waiting_per_replica * max(current, 1)
        or load.kv_cache_usage >= config.kv_cache_high
    )
    relaxed = load.waiting_requests == 0 and load.kv_cache_usage < config.kv_cache_low
    if saturated:
        # At least one more; a deep queue asks for as many as it would fill.
        by_queue = current + max(1, math.ceil(load.waiting_requests / config.target_ongoing_requests))
        wanted, reason = max(by_requests, by_queue), "saturated"
    elif relaxed:
        wanted, reason = by_requests, "relaxed"
    else:
        wanted, reason = max(by_requests, current), "holding"
    return max(config.min_replicas, min(config.max_replicas, wanted)), reason


def decide(load: Load, current: int, now: float, state: State, config: ScalingConfig) -> Decision:
    wanted, reason = wanted_replicas(load, current, config)
    if current == 0 and load.ongoing_requests > 0:
        # Scale from zero: requests are waiting for any replica at all.
        return Decision(max(wanted, 1), wanted, "cold start", State())
    direction = (wanted > current) - (wanted < current)
    if direction == 0:
        return Decision(current, wanted, reason, State())
    since = state.since if state.direction == direction and state.since is not None else now
    delay = config.upscale_delay_s if direction > 0 else config.downscale_delay_s
    if now - since < delay:
        return Decision(
            current, wanted, f"{reason}, waiting {delay - (now - since):.0f}s more", State(direction, since)
        )
    if direction > 0:
        return Decision(wanted, wanted, reason, State())
    # Down one replica per delay: the next step needs the wish to persist again.
    return Decision(current - 1, wanted, reason, State(direction, now))
