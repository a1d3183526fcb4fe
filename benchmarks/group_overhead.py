"""The engine's own cost per trajectory (RESULTS.md, "One group lifecycle"): a zero-latency sim
run, trajectories per CPU second of the process (the load of a shared machine counts less than in
wall time). Run it in two trees back to back to compare them:

    PYTHONPATH=. .venv/bin/python benchmarks/group_overhead.py LABEL
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time

from headrace.run.config import build_config
from headrace.run.train import train

STEPS, BATCH, GROUP = 20, 32, 8


async def once() -> float:
    flags = {"backend": "sim", "steps": STEPS, "batch_size": BATCH, "group_size": GROUP, "progress": False}
    config = build_config(flags=flags | {"run_dir": tempfile.mkdtemp()}, overrides=["advantages.filter_constant=false"])
    started = time.process_time()
    await train(config)
    return STEPS * BATCH * GROUP / (time.process_time() - started)


if __name__ == "__main__":
    print(sys.argv[1] if len(sys.argv) > 1 else "run", round(asyncio.run(once())))
