"""``headrace run --sampler vllm`` end to end, as a user types it: a child process, its own vLLM
engine (started under the CLI's ``__main__``, as vLLM's spawned workers require), a run dir."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
]


@pytest.mark.timeout(400)
def test_headrace_run_with_the_vllm_sampler(tmp_path):
    from headrace.backends.vllm.models import save_random_llama

    model = save_random_llama(tmp_path / "model", "tiny", seed=0)
    run_dir = tmp_path / "run"
    argv = [
        sys.executable, "-m", "headrace", "run", "--sampler", "vllm", "--model", str(model),
        "--scheduler", "async", "--steps", "2", "--batch-size", "4", "--group-size", "4",
        "--run-dir", str(run_dir), "--no-progress", "--set", "torch.lora_rank=8", "--set", "vllm.max_model_len=128",
        "--set", "advantages.filter_constant=false",  # a random model scores every member alike; train anyway
        "--set", "torch.dtype=float32",  # bfloat16 vLLM and torch kernels differ by ~2e-3 in the ratio
    ]  # fmt: skip
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["sampler"] == "vllm"
    starts = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if "run_start" in line]
    assert starts and starts[0].get("vllm_mode") == "engine"
    # max_tokens 256 (a pretrained model's default) is cut to the room left in max_model_len 128:
    # a sample that runs to it ended because the context was full, not at max_tokens
    records = [json.loads(line) for path in (run_dir / "rollouts").glob("*.jsonl") for line in path.open()]
    assert records and {r["stop_reason"] for r in records} <= {"stop", "context_overflow"}, records
    for r in records:
        if r["stop_reason"] == "context_overflow":
            assert r["prompt_tokens"] + r["completion_tokens"] == 128, r
