"""Steps/s of the schedulers on the ``tinker`` backend, through the local emulator with lock-step
clock cycles: what pipelining buys against a Tinker-like service.

    python benchmarks/tinker_clock.py --clock-cycle-s 0.5 --sample-latency-s 0.3 --steps 12

The emulator runs the embedded tiny model (``--compute torch``) on a thread of this process;
every run goes through the official SDK over loopback HTTP. Writes a JSON line per run to
``--out`` (default: benchmarks/out/tinker_clock.jsonl) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")


async def one_run(url: str, scheduler: str, args: argparse.Namespace) -> dict:
    from headrace.run.config import build_config
    from headrace.run.train import train

    flags = dict(
        backend="tinker",
        scheduler=scheduler,
        steps=args.steps,
        batch_size=args.batch_size,
        group_size=args.group_size,
        run_dir=tempfile.mkdtemp(prefix="tinker-clock-"),
        progress=False,
        max_steps_off_policy=args.max_steps_off_policy,
    )
    overrides = [f"tinker.base_url={url}", "advantages.filter_constant=false", "tinker.commit_every=0"]
    config = build_config(flags=flags, overrides=overrides)
    started = time.perf_counter()
    summary = await train(config)
    wall = time.perf_counter() - started
    ends = [r["time/total"] for r in summary.metrics]  # seconds since the start, at each step's end
    step_s = (ends[-1] - ends[0]) / max(len(ends) - 1, 1)  # steady state: the first step pays for start-up
    return {
        "scheduler": scheduler,
        "steps": args.steps,
        "wall_s": round(wall, 2),
        "steps_per_s": round(1.0 / step_s, 3) if step_s else None,
        "mean_step_s": round(step_s, 3),
        "staleness_mean": round(sum(r["staleness/mean"] for r in summary.metrics) / len(summary.metrics), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clock-cycle-s", type=float, default=0.5)
    parser.add_argument("--sample-latency-s", type=float, default=0.3)
    parser.add_argument("--latency-s", type=float, default=0.0, help="server time per training op")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-steps-off-policy", type=int, default=1)
    parser.add_argument("--schedulers", default="sync,stream,async")
    parser.add_argument("--compute", default="torch", choices=["torch", "bigram"])
    parser.add_argument("--out", default="benchmarks/out/tinker_clock.jsonl")
    args = parser.parse_args()

    from headrace.tinker_emulator import EmulatorThread, Knobs

    rows = []
    for scheduler in args.schedulers.split(","):
        knobs = Knobs(
            clock_cycle_s=args.clock_cycle_s, sample_latency_s=args.sample_latency_s, latency_s=args.latency_s
        )
        with EmulatorThread(knobs, compute=args.compute) as emu:  # a fresh server per run
            row = asyncio.run(one_run(emu.url, scheduler, args))
        row |= {
            "clock_cycle_s": args.clock_cycle_s,
            "sample_latency_s": args.sample_latency_s,
            "latency_s": args.latency_s,
            "batch_size": args.batch_size,
            "group_size": args.group_size,
            "compute": args.compute,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    base = next((r for r in rows if r["scheduler"] == "sync"), rows[0])
    print(f"\n{'scheduler':<10}{'steps/s':>10}{'s/step':>10}{'speedup':>10}{'staleness':>11}")
    for r in rows:
        print(
            f"{r['scheduler']:<10}{r['steps_per_s']:>10}{r['mean_step_s']:>10}"
            f"{r['steps_per_s'] / base['steps_per_s']:>10.2f}{r['staleness_mean']:>11}"
        )


if __name__ == "__main__":
    main()
