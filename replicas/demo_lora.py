"""Build a LoRA adapter for the demo model, locally and deterministically.

A PEFT-format adapter (adapter_config.json + adapter_model.safetensors), made
with Hugging Face's PEFT over the demo model's weights: rank-8 matrices on the
attention projections, random from a fixed seed (not PEFT's default identity
initialisation), so the adapter really changes what the model generates and a
test can tell adapter from base. Nothing is downloaded.

``python -m replicas.demo_lora [--size small] [--path DIR]`` builds one (idempotent).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from replicas.demo_model import DEFAULT_SIZE, DEMO_MODEL_VERSION, build_demo_model, build_once, data_dir

ADAPTER_VERSION = "1"
RANK = 8
SEED = 1
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]


def demo_adapter_path(size: str = DEFAULT_SIZE) -> Path:
    return data_dir() / "adapters" / f"{size}-llama-v{DEMO_MODEL_VERSION}-lora-v{ADAPTER_VERSION}"


def build_demo_adapter(path: Path | None = None, size: str = DEFAULT_SIZE) -> Path:
    """Build the adapter for the demo model of ``size`` at ``path`` unless it is there."""
    path = path or demo_adapter_path(size)
    return build_once(path, "adapter_config.json", lambda folder: _build(folder, size))


def _build(out: Path, size: str) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(build_demo_model(size=size), torch_dtype=torch.bfloat16)
    config = LoraConfig(
        r=RANK, lora_alpha=2 * RANK, target_modules=TARGET_MODULES, init_lora_weights=False, task_type="CAUSAL_LM"
    )
    torch.manual_seed(SEED)  # here, not earlier: building the base model draws from the same generator
    get_peft_model(model, config).save_pretrained(str(out), safe_serialization=True)
    # The base is a local folder whose name varies with the data dir: vLLM does
    # not need it, and a stable config keeps the build reproducible.
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = f"{size}-llama"
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True))


def main() -> None:
    from replicas.demo_model import SIZES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default=DEFAULT_SIZE)
    parser.add_argument("--path", type=Path, default=None, help="output folder")
    args = parser.parse_args()
    print(build_demo_adapter(args.path, args.size))


if __name__ == "__main__":
    main()
