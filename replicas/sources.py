"""Where a replica's weights come from: a model's ``source`` (and its LoRA
adapters) turned into folders vLLM loads. Builds the demo model and adapter
on first use; runs on the replica's node, never in the ingress."""

from __future__ import annotations

import re
from pathlib import Path

from contract.model_config import ADAPTER_NAME, DEMO_RERANKER_SOURCE, DEMO_SOURCE, PACKAGE_PREFIX, ModelConfig
from replicas.packaged_models import packaged_model_path


def resolve_source(config: ModelConfig) -> str:
    """The local path or hub id vLLM loads for ``config.source``."""
    if config.is_demo:
        from replicas.demo_model import build_demo_model

        return str(build_demo_model(size=config.demo_size))
    if config.source == DEMO_RERANKER_SOURCE:
        from replicas.demo_reranker import build_demo_reranker

        return str(build_demo_reranker())
    if config.source.startswith(PACKAGE_PREFIX):
        return str(packaged_model_path(config.source[len(PACKAGE_PREFIX) :]))
    return config.source


def resolve_adapter(config: ModelConfig, adapter: str) -> str | None:
    """The folder of ``adapter`` (a configured name or '<model>:<subfolder>'),
    or None when this model has no such adapter."""
    lora = config.lora
    if lora is None:
        return None
    source = lora.adapters.get(adapter)
    if source == DEMO_SOURCE:
        from replicas.demo_lora import build_demo_adapter

        return str(build_demo_adapter(size=config.demo_size))
    if source is not None:
        return source
    base, _, folder = adapter.partition(":")
    if lora.dir is None or base != config.name or not re.fullmatch(ADAPTER_NAME, folder):
        return None
    path = Path(lora.dir) / folder
    return str(path) if (path / "adapter_config.json").is_file() else None
