"""Hold vs regenerate for the inflight scheduler's overdue groups, on the sim (RESULTS.md,
"In-flight updates"): each scenario under both rules, several seeds, wall time and staleness.

    .venv/bin/python benchmarks/inflight_overdue.py [SEEDS]
"""

from __future__ import annotations

import statistics
import sys

import anyio

from headrace.bench.harness import run_one
from headrace.bench.scenario import load_scenario
from headrace.plugins import registry
from headrace.schedulers.inflight import InflightRegenerate


async def main(seeds: int) -> None:
    registry.schedulers.register("inflight_regenerate", InflightRegenerate)
    print("| scenario | rule | wall s (mean of seeds) | staleness mean |")
    print("|---|---|---|---|")
    for name in ("long_tail", "long_tail_heavy", "agent_tools"):
        scenario = load_scenario(name)
        for scheduler in ("inflight", "inflight_regenerate"):
            walls, stale = [], []
            for seed in range(seeds):
                result = await run_one(scenario, scheduler, f"/tmp/inflight_overdue/{name}/{scheduler}", {"seed": seed})
                walls.append(result.figures["wall_s"])
                stale.append(result.figures["staleness_mean"])
            rule = "hold" if scheduler == "inflight" else "regenerate"
            print(f"| {name} | {rule} | {statistics.mean(walls):.2f} | {statistics.mean(stale):.2f} |")


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 3)
