"""Where a zero-latency run spends its CPU, per trajectory: the breakdown behind RESULTS.md's
overhead section.

    python benchmarks/profile_overhead.py [--scheduler async] [--steps 100]

Runs the ``overhead`` scenario once plain (CPU µs per trajectory) and once under cProfile, then
prints the profile's self time grouped by who owns the code: the engine, asyncio, the sim
backend (with ``random``), the env (with the tokenizer and the dataset). cProfile inflates small
calls, so read the shares, not the absolute times. The bare-asyncio floor is measured the same
way for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import time
from collections import defaultdict

from headrace.bench.floor import floor_trajectories_per_s
from headrace.bench.scenario import load_scenario
from headrace.run.train import train

GROUPS = [
    ("sim backend + random", ("headrace/backends/sim.py", "random.py", "Random.seed", "getrandbits")),
    ("env + tokenizer + dataset", ("headrace/envs/", "headrace/tokenizers/char.py")),
    (
        "asyncio (loop, tasks, queues, task groups)",
        ("asyncio/", "_weakrefset.py", "method 'run' of '_contextvars", "_asyncio"),
    ),
    ("anyio / structlog / other libraries", ("anyio/", "structlog/", "sniffio/", "contextlib.py")),
    ("engine (headrace/core, headrace/run)", ("headrace/core/", "headrace/run/")),
]


def owner(file: str, fn: str) -> str:
    where = f"{file} {fn}"
    for name, needles in GROUPS:
        if any(n in where for n in needles):
            return name
    return "builtins called from all of the above"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scheduler", default="async")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    scenario = load_scenario("overhead")
    config = scenario.config(args.scheduler, "/tmp/headrace-profile-overhead", {"steps": args.steps})
    n = config.steps * config.batch_size * config.group_size

    cpu = time.process_time()
    asyncio.run(
        floor_trajectories_per_s(
            config.steps * config.batch_size, config.group_size, config.batch_size * 2, config.batch_size * 2
        )
    )
    floor_us = (time.process_time() - cpu) / n * 1e6
    cpu = time.process_time()
    asyncio.run(train(config))
    engine_us = (time.process_time() - cpu) / n * 1e6

    profile = cProfile.Profile()
    profile.enable()
    asyncio.run(train(config))
    profile.disable()
    shares: dict[str, float] = defaultdict(float)
    for (file, _, fn), (_, _, self_time, _, _) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        shares[owner(file, fn)] += self_time
    total = sum(shares.values())

    print(
        f"{args.scheduler}, {n} trajectories: engine {engine_us:.1f} µs CPU per trajectory, "
        f"bare-asyncio floor {floor_us:.1f} µs "
        f"(ratio {floor_us / engine_us:.1%})"
    )
    for name, seconds in sorted(shares.items(), key=lambda kv: -kv[1]):
        print(f"  {seconds / total:6.1%}  ≈ {engine_us * seconds / total:5.1f} µs  {name}")


if __name__ == "__main__":
    main()
