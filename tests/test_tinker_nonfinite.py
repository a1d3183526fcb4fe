"""A NaN loss on Tinker: ``optim_step`` is sent right behind ``forward_backward``, before the loss
is known, so the bad gradient is applied on the service before headrace can see it. The run
must stop with a clear error, and nothing holding that step may be committed, recorded as a
checkpoint or resumed from (the emulator's ``nan_loss_every`` fault; its lineage marks the
poisoned step ``nan:``, and its bigram weights really turn NaN)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import run_argv, traced_train
from tinker_support import backend_config, emulator, run_config, step_datums, tinker_env  # noqa: F401

from headrace.backends.tinker import FILENAME
from headrace.core.types import AdamParams, LossSpec
from headrace.run.backends import make_backend
from headrace.run.train import train

pytestmark = [pytest.mark.tinker, pytest.mark.timeout(120)]
HEADRACE = [sys.executable, "-c", "import sys; from headrace.app.cli import main; sys.exit(main())"]


def _clean(emu, path: str) -> bool:
    """The saved state at ``path`` holds no poisoned step, and its weights are finite."""
    ckpt = emu.emulator.state.checkpoints[path]
    weights = ckpt.blob.weights.arrays() if "/sampler_weights/" in path else ckpt.blob["params"].values()
    return not any("nan:" in step for step in ckpt.lineage) and all(np.isfinite(w).all() for w in weights)


def _recorded_paths(run_dir: Path) -> list[str]:
    manifest = json.loads((run_dir / FILENAME).read_text())
    index = run_dir / "checkpoints" / "index.jsonl"
    indexed = [json.loads(line)["path"] for line in index.read_text().splitlines()] if index.exists() else []
    return [s["path"] for s in manifest["states"]] + [s["path"] for s in manifest["samplers"]] + indexed


async def test_a_nan_loss_stops_the_backend_and_nothing_after_it_is_committed(tmp_path):
    """Before: the NaN loss was handed to the learner as a number, the commit after it was
    recorded, and a recovery or resume could start from weights holding the bad step."""
    with emulator(nan_loss_every=3) as emu:
        async with make_backend(backend_config(emu.url, tmp_path, commit_every=1)) as backend:
            training, done = backend.training, []
            for k in range(4):  # the learner's pattern: the whole step submitted, then awaited
                fb = training.forward_backward(step_datums(k), LossSpec("importance_sampling"))
                opt = training.optim_step(AdamParams(learning_rate=0.05))
                try:
                    await fb
                    await opt
                    done.append(k)
                except Exception as e:  # noqa: BLE001 - checked below
                    error = e
                    break
            with pytest.raises(Exception, match="non-finite"):  # the backend refuses to go on
                training.forward_backward(step_datums(9), LossSpec("importance_sampling"))
            model = training.client.model_id
        assert done == [0, 1], "steps after the NaN one must not resolve"
        message = str(error)
        assert "non-finite" in message and "loss=nan" in message and "optim_step had already been sent" in message
        for _ in range(100):  # the optim_step queued behind the NaN forward_backward may still be running
            if len(lineage := emu.models()[model]["lineage"]) >= 3:
                break
            await asyncio.sleep(0.05)
        assert len(lineage) == 3 and lineage[2].startswith("nan:")  # the service did apply it: it can't be refused
        trainer = emu.emulator.state.models[model].trainer
        assert not all(np.isfinite(w).all() for w in trainer.params.values())
        manifest = json.loads((tmp_path / FILENAME).read_text())
        assert [s["name"] for s in manifest["states"]] == ["commit-000000", "commit-000001", "commit-000002"]
        assert all(_clean(emu, p) for p in _recorded_paths(tmp_path))
        # the commit right after the NaN step was saved on the service, but never recorded
        assert any(not _clean(emu, p) for p in emu.emulator.state.checkpoints)


@pytest.mark.timeout(180)
async def test_a_run_stops_on_a_nan_loss_and_resumes_from_a_clean_checkpoint(tmp_path):
    """No NaN ever reaches a checkpoint the run records, and ``--resume`` continues from before it."""
    run_dir = tmp_path / "run"
    with emulator(nan_loss_every=5) as emu:  # the 5th forward_backward: step 4
        config = run_config(
            emu.url,
            run_dir,
            steps=8,
            save_every=2,
            set={"advantages.filter_constant": "false", "tinker.commit_every": 1},
        )
        with pytest.raises(Exception, match="non-finite") as info:
            await train(config)
        assert "Traceback" not in str(info.value)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1, 2, 3]
        latest = json.loads((run_dir / "checkpoints" / "latest").read_text())
        assert latest["step"] == 4
        assert all(_clean(emu, p) for p in _recorded_paths(run_dir))

        emu.set_knobs(nan_loss_every=0)
        summary = await traced_train(config.model_copy(update={"resume": True}))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(8))
        final = summary.backend.training.client.model_id
        lineage = emu.models()[final]["lineage"]
        assert len(lineage) == 8 and not any("nan:" in s for s in lineage), lineage
        assert emu.models()[final]["parent"] == latest["path"]
        assert all(_clean(emu, p) for p in _recorded_paths(run_dir))


@pytest.mark.timeout(180)
def test_the_cli_says_what_happened_in_one_paragraph(tmp_path):
    with emulator(nan_loss_every=2) as emu:
        out = subprocess.run(
            [
                *HEADRACE,
                *run_argv(
                    backend="tinker",
                    tinker_url=emu.url,
                    steps=4,
                    set={"advantages.filter_constant": "false"},
                    run_dir=tmp_path / "cli",
                ),
            ],
            capture_output=True,
            text=True,
            timeout=150,
            env={**os.environ, "TINKER_TELEMETRY": "0"},
        )
    assert out.returncode == 1, out.stderr
    assert "non-finite" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "unexpected" not in out.stderr, out.stderr
