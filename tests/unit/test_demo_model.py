"""The demo model builds locally, deterministically, in the shape vLLM's CPU backend needs."""

import hashlib
import json

from replicas.demo_model import build_demo_model


def digest(folder):
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir()) if path.is_file()
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


def test_small_size_is_a_larger_model_with_the_same_tokenizer(tmp_path):
    tiny = build_demo_model(tmp_path / "tiny")
    small = build_demo_model(tmp_path / "small", size="small")
    tiny_config, small_config = (json.loads((p / "config.json").read_text()) for p in (tiny, small))
    assert small_config["num_hidden_layers"] > tiny_config["num_hidden_layers"]
    assert small_config["hidden_size"] > tiny_config["hidden_size"] and small_config["head_dim"] == 64
    assert (small / "model.safetensors").stat().st_size > 4 * (tiny / "model.safetensors").stat().st_size
    assert digest(tiny)["tokenizer.json"] == digest(small)["tokenizer.json"]


def test_demo_sources_name_a_known_size():
    import pytest
    from pydantic import ValidationError

    from contract.model_config import ModelConfig

    ModelConfig(name="m", source="demo:small")
    with pytest.raises(ValidationError, match="demo:small"):
        ModelConfig(name="m", source="demo:huge")


def test_the_schema_knows_every_demo_size_the_builder_builds():
    from contract.model_config import DEMO_DEFAULT_SIZE, DEMO_SIZES
    from replicas.demo_model import DEFAULT_SIZE, SIZES

    assert set(DEMO_SIZES) == set(SIZES) and DEMO_DEFAULT_SIZE == DEFAULT_SIZE


def test_demo_lora_adapter_is_peft_format_and_not_an_identity(tmp_path, monkeypatch):
    from safetensors import safe_open

    from replicas.demo_lora import RANK, build_demo_adapter

    monkeypatch.setenv("LLM_CLUSTER_DATA_DIR", str(tmp_path / "data"))
    first = build_demo_adapter(tmp_path / "a")
    assert (
        digest(build_demo_adapter(tmp_path / "b"))["adapter_model.safetensors"]
        == digest(first)["adapter_model.safetensors"]
    )
    config = json.loads((first / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == RANK
    with safe_open(str(first / "adapter_model.safetensors"), "pt") as tensors:
        lora_b = [name for name in tensors.keys() if "lora_B" in name]
        assert lora_b and all(tensors.get_tensor(name).abs().sum() > 0 for name in lora_b)  # PEFT's default B is zero
