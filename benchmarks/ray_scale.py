"""The ``cpu_heavy_env`` scenario in one process and on ``--cluster ray``: trajectories/s of each
and the ratio (RESULTS.md, "Ray: scale and per-message costs").

    .venv/bin/python benchmarks/ray_scale.py                 # --repeats 3 --workers 2
    .venv/bin/python benchmarks/ray_scale.py --workers 1,2 --out benchmarks/out/ray_scale.json

Each run is the bench harness's own (``headrace.bench.harness.run_one``, the figures ``headrace
bench`` reports: wall time is the training loop's, from the actors' start to the last step, so
Ray's start-up is not in it; it is reported apart). The runs alternate (one process, Ray, one
process, Ray, ...) so that a noisy stretch of the shared machine falls on both; every Ray run
starts and stops its own local Ray instance, as ``headrace bench --set cluster.kind=ray`` does, so
no idle Ray daemon runs beside a one-process run. ``driver CPU`` is this process's CPU seconds
(on Ray: the driver only, not the workers, replica or learner); ``cores busy`` is the whole
machine's (``/proc/stat``, other users' jobs included) from the first step's row to the last.
Nothing is tuned for either side: the scenario's config, Ray's defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from headrace.bench.harness import run_one
from headrace.bench.scenario import load_scenario


def cpu_jiffies() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine."""
    fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


async def one(kind: str, workers: int, scheduler: str, tmp: str, steps: int | None) -> dict[str, Any]:
    scenario = load_scenario("cpu_heavy_env")
    overrides: dict[str, Any] = {}
    if steps is not None:
        overrides["steps"] = steps
    if kind == "ray":
        overrides["cluster"] = {"kind": "ray", "rollout_workers": workers}
    marks: list[tuple[float, float]] = []
    load = os.getloadavg()[0]

    started = time.perf_counter()
    result = await _run_with_marks(scenario, scheduler, tmp, overrides, marks)
    total = time.perf_counter() - started
    f = result.figures
    busy = None
    if len(marks) >= 2:
        (b0, t0), (b1, t1) = marks[0], marks[-1]
        busy = (b1 - b0) / (t1 - t0) * (os.cpu_count() or 1) if t1 > t0 else None
    return {
        "kind": kind if kind == "none" else f"ray x{workers}",
        "wall_s": f["wall_s"],
        "trajectories_per_s": f["trajectories_per_s"],
        "driver_cpu_s": f["cpu_s"],
        "startup_and_teardown_s": total - f["wall_s"],
        "cores_busy": busy,
        "load_avg_1m_before": round(load, 2),
        "staleness_mean": f["staleness_mean"],
        "rollout_errors": f["rollout_errors"],
    }


async def _run_with_marks(scenario, scheduler, tmp, overrides, marks):
    """run_one, with /proc/stat read at every step's row (the harness's ``train`` wrapped, its
    own ``on_step`` still called)."""
    from headrace.bench import harness

    original = harness.train

    async def train(config, on_step=None, **kwargs):
        def watched(row):
            marks.append(cpu_jiffies())
            if on_step is not None:
                on_step(row)

        return await original(config, on_step=watched, **kwargs)

    harness.train = train
    try:
        return await run_one(scenario, scheduler, tmp, overrides)
    finally:
        harness.train = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="2", help="rollout worker counts for the Ray runs, comma-separated")
    parser.add_argument("--scheduler", default="async")
    parser.add_argument("--steps", type=int, default=None, help="override the scenario's steps (12)")
    parser.add_argument("--out", help="write every run's figures here (JSON)")
    args = parser.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    plan = [("none", 0)] + [("ray", w) for w in workers]
    runs: list[dict[str, Any]] = []
    for r in range(args.repeats):
        for kind, w in plan:
            with tempfile.TemporaryDirectory(prefix="ray-scale-") as tmp:
                row = anyio.run(one, kind, w, args.scheduler, tmp, args.steps)
            row["repeat"] = r
            runs.append(row)
            busy = f"{row['cores_busy']:.2f}" if row["cores_busy"] is not None else "-"
            print(
                f"[{r}] {row['kind']:>8}: wall {row['wall_s']:6.2f} s  {row['trajectories_per_s']:6.1f} traj/s  "
                f"driver CPU {row['driver_cpu_s']:5.2f} s  cores busy {busy}  "
                f"start+stop {row['startup_and_teardown_s']:5.1f} s  "
                f"load {row['load_avg_1m_before']}",
                flush=True,
            )
    print()
    print("| run | traj/s median (min-max) | wall s | driver CPU s | cores busy | vs one process |  (medians)")
    print("|---|---:|---:|---:|---:|---:|")
    base = None
    for kind in dict.fromkeys(row["kind"] for row in runs):
        rows = [x for x in runs if x["kind"] == kind]
        tps = [x["trajectories_per_s"] for x in rows]
        med = statistics.median(tps)
        base = med if base is None else base
        busy = [x["cores_busy"] for x in rows if x["cores_busy"] is not None]
        print(
            f"| {kind} | {med:.1f} ({min(tps):.1f}-{max(tps):.1f}) | "
            f"{statistics.median(x['wall_s'] for x in rows):.2f} | "
            f"{statistics.median(x['driver_cpu_s'] for x in rows):.2f} | "
            f"{statistics.median(busy) if busy else float('nan'):.2f} | {med / base:.2f}x |"
        )
    pairs = [
        (b["trajectories_per_s"] / a["trajectories_per_s"], b["kind"])
        for a in runs
        if a["kind"] == "none"
        for b in runs
        if b["kind"] != "none" and b["repeat"] == a["repeat"]
    ]
    for kind in dict.fromkeys(k for _, k in pairs):
        ratios = [r for r, k in pairs if k == kind]
        print(f"{kind} / one process, per repeat: " + ", ".join(f"{r:.2f}" for r in ratios))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(runs, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
