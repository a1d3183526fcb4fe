"""Small builders shared by the engine tests."""

from __future__ import annotations

from typing import Any

from headrace.engine.config import build_config
from headrace.engine.run import RunSummary, train


def sim_config(tmp_path, **flags: Any):
    base = dict(backend="sim", steps=6, batch_size=4, group_size=4, run_dir=str(tmp_path / "run"), progress=False)
    base |= flags
    overrides = [f"{k}={v}" for k, v in base.pop("set", {}).items()]
    return build_config(flags=base, overrides=overrides)


async def run_sim(tmp_path, dataset=None, **flags: Any) -> RunSummary:
    return await train(sim_config(tmp_path, **flags), dataset=dataset)
