"""Machine instructions per trajectory of the ``overhead`` scenario (sync), under valgrind's
cachegrind: a figure that does not move with the machine's load, unlike CPU seconds.

    python benchmarks/overhead_instructions.py [--steps 10]

Runs this file twice under ``valgrind --tool=cachegrind --cache-sim=no``: a warm-up run of one
step then ``--steps`` steps, and the warm-up alone; the difference over the trajectories trained
is the figure (imports and start-up cancel out). About a minute per tree.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import tempfile


def inner(steps: int) -> None:
    from headrace.bench.scenario import load_scenario
    from headrace.run.train import train

    tmp = tempfile.mkdtemp(prefix="headrace-ir")
    scenario = load_scenario("overhead")

    async def main() -> None:
        await train(scenario.config("sync", f"{tmp}/warm", {"steps": 1}))  # imports, caches
        if steps:
            await train(scenario.config("sync", f"{tmp}/run", {"steps": steps}))

    asyncio.run(main())


def instructions(steps: int) -> int:
    out = subprocess.run(
        [
            "valgrind",
            "--tool=cachegrind",
            "--cache-sim=no",
            "--cachegrind-out-file=/dev/null",
            sys.executable,
            __file__,
            "--inner",
            str(steps),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    return int(re.search(r"I\s+refs:\s+([\d,]+)", out).group(1).replace(",", ""))  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--inner", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner is not None:
        inner(args.inner)
        return
    from headrace.bench.scenario import load_scenario

    config = load_scenario("overhead").config("sync", "/tmp/unused", {"steps": args.steps})
    n = args.steps * config.batch_size * config.group_size
    print(f"{(instructions(args.steps) - instructions(0)) / n:,.0f} instructions per trajectory")


if __name__ == "__main__":
    main()
