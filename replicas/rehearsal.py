"""A deployment rehearsed without its engine: ``engine: replicas.rehearsal:start_recording``.

It takes the path a replica takes up to the engine's start, for real: Ray places
the replica as the model's config asks (GPUs, an accelerator type, a placement group
for tensor parallelism), vLLM parses the same command line and builds its
``VllmConfig`` (which decides the executor from where the replica runs), and the
replica records all of it (``engine_facts``). It starts no engine and serves no
operation. So a GPU config is checked on a cluster that has no such GPU (Ray's
logical GPUs, ``ray start --num-gpus``), and a real GPU cluster's placement is
checked before weights are loaded. What differs on a GPU node: vLLM's CUDA platform
(the CPU build's executor for one rank is ``mp``, CUDA's ``uni``)."""

from __future__ import annotations

from contract.model_config import ModelConfig
from replicas.vllm_engine import EngineBinding, engine_config, placement_facts


class IdleEngine:
    """Stands where vLLM's ``AsyncLLM`` would: healthy, never running anything."""

    errored = False

    def get_num_unfinished_requests(self) -> int:
        return 0

    async def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


async def start_recording(config: ModelConfig) -> EngineBinding:
    from replicas.engine_stats import EngineLoad

    _, _, vllm_config = engine_config(config)
    return EngineBinding(
        engine=IdleEngine(),
        load=EngineLoad(),
        max_model_len=vllm_config.model_config.max_model_len,
        endpoints={},
        facts={**placement_facts(vllm_config), "engine": "recording (not started)"},
    )
