"""Build the tiny demo model served on machines without a GPU.

A Llama-architecture model in Hugging Face format, made locally and
deterministically: a byte-level BPE tokenizer trained on the repository's
LICENSE text, a ChatML chat template, and random weights from a fixed seed.
Nothing is downloaded. Its output is gibberish, but it exercises the real
vLLM engine end to end (tokenizer, chat template, sampling, streaming), which
is what tests and the local run need.

Run ``python -m replicas.demo_model`` to build it (idempotent) and print its path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from contract.model_config import DEMO_DEFAULT_SIZE

# Bump when anything below changes what gets built: it names the cache folder.
DEMO_MODEL_VERSION = "2"

CORPUS = Path(__file__).resolve().parent.parent / "LICENSE"
VOCAB_SIZE = 1024
SEED = 0
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Reasoning models' markers, as ordinary (non-special) tokens: vLLM's reasoning
# parsers need them in the vocabulary to serve a "thinking" variant of the demo.
THINK_TOKENS = ["<think>", "</think>"]

# ChatML, the format most open chat models use; generation prompt opens an
# assistant turn so vLLM's chat layer behaves as it does with real models.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_COMMON = dict(
    head_dim=64,  # vLLM's CPU attention supports 32/64/128 only
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# Sizes of the demo model (config source `demo` = tiny, `demo:<size>`): same
# tokenizer, different depth and width, so a multi-model config serves models
# that really differ in cost. tiny ~0.6M parameters, small ~3.9M.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        **_COMMON,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        **_COMMON,
    ),
}
DEFAULT_SIZE = DEMO_DEFAULT_SIZE  # the config schema validates `demo:<size>` against DEMO_SIZES


def data_dir() -> Path:
    """Where built artefacts are cached (``LLM_CLUSTER_DATA_DIR``)."""
    default = Path.home() / ".cache" / "llm-cluster"
    return Path(os.environ.get("LLM_CLUSTER_DATA_DIR", default))


def demo_model_path(size: str = DEFAULT_SIZE) -> Path:
    corpus_digest = hashlib.sha256(CORPUS.read_bytes()).hexdigest()[:12]
    return data_dir() / "models" / f"{size}-llama-v{DEMO_MODEL_VERSION}-{corpus_digest}"


def _train_tokenizer(out: Path):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train(
        files=[str(CORPUS)],
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.add_tokens(THINK_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return tokenizer


def _build_weights(out: Path, tokenizer, size: str) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **SIZES[size],
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    # Only the token ids: no sampling defaults that would make vLLM's
    # behaviour differ from what a request asks for.
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)


def build_demo_model(path: Path | None = None, size: str = DEFAULT_SIZE) -> Path:
    """Build the demo model of ``size`` at ``path`` unless it is already there."""
    if size not in SIZES:
        raise ValueError(f"unknown demo model size {size!r}; one of {', '.join(SIZES)}")
    path = path or demo_model_path(size)

    def build(tmp: Path) -> None:
        tokenizer = _train_tokenizer(tmp)
        _build_weights(tmp, tokenizer, size)
        (tmp / "BUILD_INFO.json").write_text(
            json.dumps({"version": DEMO_MODEL_VERSION, "size": size, "seed": SEED, "corpus": CORPUS.name})
        )

    return build_once(path, "config.json", build)


def build_once(path: Path, marker: str, build) -> Path:
    """``build(folder)`` into a scratch folder, then rename it to ``path``: a
    half-built artefact is never seen, and of concurrent builders (replicas
    starting together) the first rename wins. ``path/marker`` means built."""
    if (path / marker).exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        tmp = Path(scratch) / "build"
        build(tmp)
        try:
            tmp.rename(path)
        except OSError:
            if not (path / marker).exists():  # lost the race to another builder: fine
                raise
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, default=None, help="output folder")
    parser.add_argument("--size", choices=sorted(SIZES), default=DEFAULT_SIZE)
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args()
    path = args.path or demo_model_path(args.size)
    if args.force and path.exists():
        shutil.rmtree(path)
    print(build_demo_model(path, args.size))


if __name__ == "__main__":
    main()
