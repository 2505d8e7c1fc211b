"""The demo model builds locally, deterministically, in the shape vLLM's CPU backend needs."""

import hashlib
import json

from replicas.demo_model import build_demo_model


def digest(folder):
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.iterdir())
        if path.is_file()
    }


def test_builds_the_same_bytes_twice(tmp_path):
    first = build_demo_model(tmp_path / "a")
    second = build_demo_model(tmp_path / "b")
    assert digest(first) == digest(second)
    assert "model.safetensors" in digest(first)


def test_is_a_chat_capable_llama_with_cpu_friendly_heads(tmp_path):
    from transformers import AutoTokenizer

    path = build_demo_model(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] == 64
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"


def test_second_call_reuses_the_cached_build(tmp_path):
    path = build_demo_model(tmp_path / "m")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert build_demo_model(path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
