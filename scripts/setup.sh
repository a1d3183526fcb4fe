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
