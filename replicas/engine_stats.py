"""The engine's own view of its load, kept from vLLM's stat-logger hook.

vLLM hands every stat logger the scheduler's numbers after each engine step;
keeping the latest copy lets the replica answer "how busy is the engine"
(running and waiting requests, KV-cache use) without a round trip to the
engine process. Autoscaling and tests read it through the replica.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vllm.v1.metrics.loggers import StatLoggerBase


@dataclass
class EngineLoad:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    # Prompt tokens looked up in the prefix cache, and found there, since the
    # engine started: their ratio is what prefix-affinity routing is for.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class EngineLoadRecorder(StatLoggerBase):
    """A stat logger that only remembers the newest scheduler stats."""

    def __init__(self, load: EngineLoad):
        self.load = load

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if scheduler_stats is not None:
            self.load.running = scheduler_stats.num_running_reqs
            self.load.waiting = scheduler_stats.num_waiting_reqs
            self.load.kv_cache_usage = scheduler_stats.kv_cache_usage
            prefix = scheduler_stats.prefix_cache_stats
            self.load.prefix_cache_queries += prefix.queries
            self.load.prefix_cache_hits += prefix.hits

    def log_engine_initialized(self):
        pass


def recorder_factory(load: EngineLoad):
    """vLLM wants a factory ``(vllm_config, engine_index) -> logger``."""
    return lambda vllm_config, engine_index=0: EngineLoadRecorder(load)
