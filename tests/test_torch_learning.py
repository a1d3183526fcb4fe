"""The torch backend learns: the engine end to end on the default env, embedded tiny model, CPU."""

from __future__ import annotations

import statistics

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from headrace.run.config import build_config  # noqa: E402
from headrace.run.train import train  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_reward_rises_well_above_chance_on_the_default_env(tmp_path):
    # the shipped defaults, spelled out so this budget stays the same if they move
    config = build_config(
        flags={"run_dir": str(tmp_path / "run"), "progress": False, "seed": 0, "steps": 40},
        overrides=[
            "backend=torch",
            "model=tiny",
            "env=arithmetic",
            "env_options={max_operand=4}",
            "batch_size=32",
            "group_size=16",
            "sampling.max_tokens=4",
            "optim.learning_rate=3e-4",
            "advantages.normalize_std=true",
        ],
    )
    summary = await train(config)
    rewards = [row["reward/mean"] for row in summary.metrics]
    first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    assert first < 0.3, f"the untrained model should be near chance, got {first:.3f}"
    assert last > first + 0.3 and last > 0.5, f"reward went from {first:.3f} to {last:.3f} in 40 steps"
