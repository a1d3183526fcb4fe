"""The same command twice gives the same run: a sync run with a seed is reproducible on one machine.

Each test runs one `headrace run` command twice, each in its own process, and compares the
metrics rows without their timing figures. What made them differ (and no longer does): which
sample requests shared a batch (so which rows a batched forward computed together), the order
groups reached the learner (so the order of the datums it trained on), the order a batch's answers
woke the rollouts, and LoRA's initial weights drawn from the process's global RNG.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_argv

# figures that measure time, or what was waiting at some instant
TIMING = ("time/", "throughput/trajectories_per_s", "throughput/tokens_per_s", "queue/", "perf/")  # perf/: rates, MFU


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows]


def run_twice(tmp_path: Path, timeout: float, environ: dict[str, str] | None = None, **flags) -> tuple[list, list]:
    runs = []
    for name in ("first", "second"):
        argv = [sys.executable, "-m", "headrace", *run_argv(run_dir=tmp_path / name, seed=0, **flags)]
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(environ or {})}, check=False
        )
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(metrics(tmp_path / name))
    return runs[0], runs[1]


def first_difference(a: list[dict], b: list[dict]) -> str:
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        keys = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
        if keys:
            first, second = [x.get(k) for k in keys[:3]], [y.get(k) for k in keys[:3]]
            return f"step {step} differs in {', '.join(keys[:6])}: {first} vs {second}"
    return "identical"


def assert_same_run(a: list[dict], b: list[dict], steps: int) -> None:
    assert len(a) == len(b) == steps
    assert a == b, first_difference(a, b)


def test_a_sync_sim_run_repeats_itself(tmp_path):
    # jittered latencies: groups finish in another order each time, so the learner used to sum
    # the step's loss in another order (``optim/loss:sum`` differed in its last digits)
    latency = {"sim.sample_token_s": 0.002, "sim.sample_jitter": 1.0}
    a, b = run_twice(tmp_path, 60, backend="sim", steps=20, batch_size=8, group_size=8, set=latency)
    assert_same_run(a, b, 20)


@pytest.mark.slow  # two processes that load torch: ~15 s on a quiet machine
@pytest.mark.parametrize(
    ("scheduler", "torch_set"),
    [("sync", {}), ("stream", {"torch.max_sample_batch": 6})],  # 6: a round fills several batches
)
def test_a_torch_run_on_a_multi_turn_env_repeats_itself(tmp_path, scheduler, torch_set):
    """The embedded tiny model, guess_number (up to 16 turns): each turn's requests used to share
    a batch by when they arrived, and the first or second step's figures already differed."""
    pytest.importorskip("torch")
    flags = dict(backend="torch", env="guess_number", steps=4, batch_size=4, group_size=4, scheduler=scheduler)
    overrides = {"advantages.filter_constant": "false", **torch_set}
    a, b = run_twice(tmp_path, 150, **flags, num_minibatches=2, set=overrides)
    assert_same_run(a, b, 4)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sync_smollm2_run_repeats_itself(tmp_path):
    """The issue's case: SmolLM2 with LoRA on one thread diverged from its third step (the
    groups reached the learner in another order, and the first samples shared batches by timing)."""
    pytest.importorskip("gguf")
    from headrace.models import ModelLoadError, model_dir

    try:
        model_dir("smollm2-135m")  # converts the GGUF once (~100 s), before either run is timed
    except ModelLoadError as e:
        pytest.skip(str(e))
    flags = dict(backend="torch", model="smollm2-135m", max_tokens=16, batch_size=4, group_size=8, steps=3)
    a, b = run_twice(tmp_path, 400, **flags, set={"torch.num_threads": 1})
    assert_same_run(a, b, 3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sync_run_against_the_tinker_emulator_repeats_itself(tmp_path, monkeypatch):
    """``--backend tinker`` through the official SDK, twice against one emulator (torch compute,
    the tiny model, guess_number): the emulator drew the LoRA adapter's initial weights from the
    process's global RNG, so its second run started from other weights; and its sampler batched
    the requests by when they came in over HTTP."""
    pytest.importorskip("tinker")
    from headrace.tinker_emulator import EmulatorThread, Knobs

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with EmulatorThread(Knobs(), compute="torch") as emu:
        flags = dict(backend="tinker", tinker_url=emu.url, env="guess_number", steps=3, batch_size=4, group_size=4)
        a, b = run_twice(tmp_path, 240, **flags, set={"advantages.filter_constant": "false"})
    assert_same_run(a, b, 3)
