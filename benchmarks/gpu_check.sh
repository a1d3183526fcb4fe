#!/usr/bin/env bash
# GPU check for the vllm sampler and the torch learner, on a lent GPU machine with no internet:
# builds a ~0.49 B-parameter random Llama from a config (headrace/backends/vllm/models.py, preset
# 0.5b: nothing is downloaded) and reports, in one run of benchmarks/vllm_vs_torch.py,
#   - sampled tokens/s of the vLLM sampler (in-process engine, LoRA rank 32) and of the torch
#     sampler at batch sizes 1, 16, 64, 256 (256 new tokens each),
#   - the extra latency of the first request on a newly published LoRA version,
#   - torch training tokens/s (forward_backward + optim_step + publish) for LoRA and full fine-tuning,
#   - the same GRPO step in float32 and bfloat16 (benchmarks/real_model_speed.py: step time, tokens/s,
#     MFU per phase against the peak probed in each dtype) and `headrace check numerics` in both.
# Budget: under 14 minutes (model build ~0.5 min, vLLM start ~1-2 min, measurements ~2 min).
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine; results also in $OUT or benchmarks/out
#   bash benchmarks/gpu_check.sh --fetch-wheels  # here, where pip reaches PyPI: see below
#   bash benchmarks/gpu_check.sh --smoke         # the same steps on CPU with the tiny model (a minute)
#
# The GPU image has PyTorch, transformers and peft but not headrace's small pure-Python
# dependencies (pydantic, structlog, tenacity); --fetch-wheels downloads them for Python 3.12
# into benchmarks/out/wheels (git-ignored): carry that folder. vLLM itself (hundreds of MB, pinned
# to its own CUDA torch) cannot travel that way: where the machine has no vLLM, the check measures
# the torch sampler and the learner and says that vLLM was skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=benchmarks/out/wheels
WHEEL_SPECS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
             typing-extensions==4.16.0 structlog==26.1.0 tenacity==9.2.1)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p "$WHEELS"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" "${WHEEL_SPECS[@]}"
    ls -l "$WHEELS"
    exit 0
fi

started=$(date +%s)
out=${OUT:-benchmarks/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if ! "$PY" -c "import pydantic, structlog, tenacity" 2>/dev/null; then
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "gpu_check: pydantic, structlog or tenacity is missing and $WHEELS holds no wheels;" \
             "run 'bash benchmarks/gpu_check.sh --fetch-wheels' where pip works and carry $WHEELS" >&2
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/headrace-site "$WHEELS"/*.whl
    export PYTHONPATH=/tmp/headrace-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

if [[ "${1:-}" == "--smoke" ]]; then
    args=(--preset tiny --dtype float32 --batch-sizes 1 8 --max-tokens 32 --max-model-len 256 --rounds 1
          --lora-rank 8 --gpu-memory-utilization 0.2 --train lora full --train-batch 8 --train-len 64)
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    args=(--preset 0.5b --dtype bfloat16 --device cuda --batch-sizes 1 16 64 256 --max-tokens 256
          --max-model-len 1024 --rounds 2 --lora-rank 32 --gpu-memory-utilization 0.5
          --train lora full --train-batch 32 --train-len 512)
fi
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.cuda.is_available())"
"$PY" -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null \
    || echo "vllm: not installed here: the sampling part measures the torch sampler only"

timeout 450 "$PY" benchmarks/vllm_vs_torch.py "${args[@]}" --out "$out/gpu_check.json" 2>&1 \
    | grep -vE '^\((EngineCore|Worker|APIServer|VllmWorker)|it/s\]' | tee "$out/gpu_check.log"

# Mixed precision and MFU (issue 24): the same GRPO step (8 prompts x 8 samples, 16 tokens, LoRA 16)
# in float32 then bfloat16 on this device, back to back: step time, sampled tokens/s, perf/mfu_train
# and perf/mfu_sample against the peak probed in each dtype; then the sampler-learner numerics check.
if [[ "${1:-}" == "--smoke" ]]; then
    speed_model=tiny
else
    speed_model=$(mktemp -d /tmp/headrace-gpu-model-XXXX)
    "$PY" -c "from headrace.backends.vllm.models import save_random_llama as s; s('$speed_model', '0.5b', seed=0, dtype='bfloat16')"
fi
timeout 180 "$PY" benchmarks/real_model_speed.py --model "$speed_model" --dtypes float32,bfloat16 --steps 2 \
    2>&1 | grep -vE 'it/s\]' | tee "$out/gpu_check_mixed_precision.log" || echo "gpu_check: the mixed-precision step failed"
for dtype in float32 bfloat16; do
    timeout 90 "$PY" -m headrace check numerics --model "$speed_model" --episodes 64 --max-tokens 16 \
        --set torch.dtype=$dtype 2>&1 | grep -vE 'it/s\]' | tee -a "$out/gpu_check_numerics.log" \
        || echo "gpu_check: the numerics check ($dtype) failed"
done
echo "gpu_check: $(($(date +%s) - started)) s in all; results in $out/gpu_check.json, $out/gpu_check_mixed_precision.log, $out/gpu_check_numerics.log"
