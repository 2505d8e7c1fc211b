"""Models the shared stack runs besides configs/local.yaml's."""

from __future__ import annotations

# The demo cross-encoder (replicas/demo_reranker.py): /score and /rerank's pair path.
RERANKER = {
    "name": "minilm-reranker",
    "source": "demo-reranker",
    "accelerator": "cpu",
    "cpus_per_replica": 0.25,
    "engine_kwargs": {"max_model_len": 256},
    "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
    "deployment": {"num_replicas": 1, "max_ongoing_requests": 16},
}
