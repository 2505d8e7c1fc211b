"""vLLM's own metrics through Ray's metrics system, without per-token observations.

vLLM's Ray stat logger (``RayPrometheusStatLogger``, what Ray Serve LLM uses)
observes its inter-token-latency histogram once per generated token. Each
node's Ray metrics agent re-records every histogram observation one by one
(``record_histogram_aggregated_batch``: one OpenTelemetry ``record`` per
observation, at each 10 s export; ray-project/ray#64852), so this one
histogram makes the agent's work grow with the node's token rate: on a 2-core
box at c=32 it took the agent 0.2-0.7 s of a core every 10 s, at its nice 0
against the replicas' and engines' 15, and the replica got no CPU meanwhile
(docs/performance.md). Everything else vLLM exports is per step or per
request and stays, the per-request time per output token included.
``ModelConfig.inter_token_latency_histogram`` turns the per-token one back on.
"""

from __future__ import annotations

from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger


class _Unobserved:
    """A histogram that takes observations and keeps none."""

    def observe(self, value: float) -> None:
        pass


class PerRequestRayStatLogger(RayPrometheusStatLogger):
    """``RayPrometheusStatLogger`` whose inter-token-latency histogram observes nothing."""

    def __init__(self, vllm_config, engine_indexes: list[int] | None = None):
        super().__init__(vllm_config, engine_indexes)
        # A stand-in that observes nothing, where vLLM keeps its histograms (vLLM is read as Any).
        indexes = list(self.histogram_inter_token_latency)  # type: ignore[has-type]
        self.histogram_inter_token_latency = {index: _Unobserved() for index in indexes}


def ray_stat_logger(inter_token_latency_histogram: bool):
    """The stat-logger class (vLLM's factory) for a model's engine."""
    return RayPrometheusStatLogger if inter_token_latency_histogram else PerRequestRayStatLogger
