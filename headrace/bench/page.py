"""``RESULTS.md`` and the headline plot, from every scenario of ``headrace bench --all``."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headrace.bench.harness import RunResult
from headrace.bench.report import COLORS, fmt, markdown_table
from headrace.bench.scenario import Scenario

REGENERATE = "headrace bench --all --repeats 3 --out benchmarks"


@dataclass
class Entry:
    scenario: Scenario
    results: list[RunResult] | None  # None: skipped
    note: str = ""

    def by_name(self) -> dict[str, dict[str, Any]]:
        return {r.scheduler: r.figures for r in self.results or []}


def headline_table(entries: list[Entry]) -> str:
    lines = [
        "| scenario | `sync` wall | `stream` vs sync | `async` vs sync "
        "| efficiency sync / stream / async | `async` staleness mean / max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for e in entries:
        f = e.by_name()
        if not f or "overhead_ratio" in next(iter(f.values())):
            continue
        sync, stream, asyn = f.get("sync", {}), f.get("stream", {}), f.get("async", {})
        eff = " / ".join(fmt(x.get("efficiency"), "{:.2f}") for x in (sync, stream, asyn))
        lines.append(
            f"| {e.scenario.name} | {fmt(sync.get('wall_s'), '{:.2f} s')} "
            f"| {fmt(stream.get('speedup_vs_sync'), '{:.2f}x')} "
            f"| {fmt(asyn.get('speedup_vs_sync'), '{:.2f}x')} | {eff} "
            f"| {fmt(asyn.get('staleness_mean'), '{:.2f}')} / {fmt(asyn.get('staleness_max'), '{:.0f}')} |"
        )
    return "\n".join(lines)


def overhead_line(entries: list[Entry]) -> str:
    for e in entries:
        f = e.by_name()
        if f and "overhead_ratio" in next(iter(f.values())):
            parts = [
                f"`{name}` {fmt(x['trajectories_per_s'], '{:,.0f}')} traj/s = "
                f"{fmt(x['overhead_ratio'], '{:.0%}')} of the floor's {fmt(x['floor_trajectories_per_s'], '{:,.0f}')} "
                f"({fmt(x.get('overhead_ratio_cpu'), '{:.0%}')} per CPU second)"
                for name, x in f.items()
            ]
            return (
                "**Engine overhead** (zero-latency sim, trajectories/s through the whole actor graph vs a bare-asyncio "
                "floor of the same shape in the same process; target ≥ 50%): " + "; ".join(parts) + ". See "
                "[overhead](#overhead) for what limits it."
            )
    return ""


def headline_plot(path: Path, entries: list[Entry]) -> None:
    """Speedup over sync per scenario, stream and async, with the ideal bounds' speedup as ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        e
        for e in entries
        if e.results
        and "sync" in e.by_name()
        and e.by_name()["sync"].get("ideal_s")
        and "overhead_ratio" not in e.results[0].figures
    ]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 3.8), constrained_layout=True)
    width = 0.38
    for j, name in enumerate(("stream", "async")):
        xs, ys, ideal = [], [], []
        for i, e in enumerate(rows):
            f = e.by_name()
            if name not in f:
                continue
            xs.append(i + (j - 0.5) * width)
            ys.append(f[name]["speedup_vs_sync"])
            si, ti = f["sync"].get("ideal_s"), f[name].get("ideal_s")
            ideal.append(si / ti if si and ti else math.nan)
        bars = ax.bar(xs, ys, width, color=COLORS[name], label=f"{name} (measured)")
        ax.bar_label(bars, [f"{y:.2f}x" for y in ys], fontsize=7, padding=2)
        ax.scatter(xs, ideal, marker="_", s=500, color="black", zorder=3, label="ideal bounds' ratio" if j else None)
    ax.axhline(1.0, color=COLORS["sync"], lw=1, ls="--", label="sync")
    ax.set_xticks(range(len(rows)), [e.scenario.name for e in rows], rotation=20, ha="right")
    ax.set_ylabel("speedup over sync (wall time)")
    ax.set_title("headrace schedulers on the sim latency model (same steps, same work)", fontsize=10)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.2)
    ax.legend(fontsize=8, loc="upper left", ncol=4)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _machine_lines(machine: dict[str, Any]) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in machine.get("versions", {}).items())
    lines = [
        f"- CPU: {machine.get('cpu')}, {machine.get('nproc')} logical cores (`nproc`)",
        f"- Python {machine.get('python')} on {machine.get('platform')}",
        f"- {versions}",
    ]
    if "load_avg_1m" in machine:
        lines.append(
            f"- 1-minute load average when the benchmarks started: {machine['load_avg_1m']} "
            "(other work on the machine inflates wall times)"
        )
    return lines


READING_TEXT = """\
Reading it: `async` overlaps a batch's sampling with the previous batch's training, so its speedup
is bounded by (S + T) / max(S, T): about 2x when sampling and training take equally long
(balanced, multi_turn, remote_api, flaky), 1.25x when one is 4x the other. `stream` stays on-policy
and overlaps training only with the slowest rollouts of the same batch; it pays `train_step_s`
per `forward_backward` call (4 calls a step instead of 1), so it beats `sync` only where rollouts
finish unevenly (long_tail, flaky) and is slower elsewhere. Its ideal bound (the black ticks) says
the same, so that is the scenario's shape, not engine cost. Efficiency is what the engine costs
on top of the bound: a few percent per run (event-loop wake-ups, Python work on the critical
path, and whatever else the machine was running)."""


IDEAL_TEXT = """\
The **ideal bound** of a run replays the work the run actually did (every sample request's
modelled cost, every training call's modelled duration, as the `sim` backend recorded them)
through the latency model and the scheduler's admission rule with a free engine: no Python time,
no timer latency, the learner never idle while it has data. Per batch k: `S_k` = its sampling
critical path = max(longest request chain of a group, request-seconds / sampler concurrency);
`T_k` = its training time (`forward_backward` calls + optimizer step, on lock-step clock
boundaries where `clock_cycle_s` is set).

- `sync`: ideal = Σ_k (S_k + T_k).
- `async` (`max_steps_off_policy` = m): batch k is admitted when step k−m−1 is published; with a
  sampler one batch saturates this is the pipeline bound max(S_0 + Σ T_k, Σ S_k + T_last), i.e.
  max(total sampling, total training) plus the unavoidable first sampling or last training.
- `stream`: as `sync`, but minibatch m's `forward_backward` may start once its groups are in.

**Efficiency** = ideal / measured wall time (1.0 = the engine costs nothing); **speedup** = `sync`
wall / this scheduler's wall at the same number of steps. The precise definitions are in the
docstring of `headrace/bench/ideal.py`; the figures per run in `headrace/bench/harness.py`."""


def _repeats(entries: list[Entry]) -> int:
    return max((r.figures.get("repeats", 1) for e in entries for r in e.results or []), default=1)


def write_page(out: Path, entries: list[Entry], machine: dict[str, Any], wall_s: float) -> Path:
    headline_plot(out / "headline.png", entries)
    lines = [
        "# headrace throughput benchmarks",
        "",
        "Regenerate everything on this page (tables, JSON, plots) with one command, from the repo root:",
        "",
        f"```\n{REGENERATE}\n```",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M')} in {wall_s:.0f} s on:",
        "",
        *_machine_lines(machine),
        "",
        "Each scenario is a small TOML file in `headrace/bench/scenarios/` (a run config plus a `[bench]` table); "
        "`headrace bench --scenario NAME_OR_FILE` runs one, `--list` lists them. All schedulers of a scenario run "
        "one after another in one process, with the same seed and the same number of steps. Wall time is the "
        "training loop's (actors started → last step reported). "
        f"Each scheduler ran {_repeats(entries)} time(s); the tables show its least disturbed run (highest efficiency, "
        "or lowest wall time where there is no bound), since other processes on a shared machine can stall a run "
        "for seconds; every run's wall time is in the JSON (`wall_s_runs`).",
        "",
        "## Headline",
        "",
        headline_table(entries),
        "",
    ]
    overhead = overhead_line(entries)
    if overhead:
        lines += [overhead, ""]
    lines += [
        "![speedup over sync per scenario](headline.png)",
        "",
        READING_TEXT,
        "",
        "## How the ideal bound is computed",
        "",
        IDEAL_TEXT,
        "",
    ]
    lines += ["## Scenarios", ""]
    for e in entries:
        s = e.scenario
        lines += [
            f"### {s.name}",
            "",
            s.description + ("." if s.description and not s.description.endswith(".") else ""),
            "",
        ]
        if e.results is None:
            lines += [f"Not run: {e.note}", ""]
            continue
        lines += [markdown_table(e.results), ""]
        if s.notes:
            lines += [s.notes, ""]
        if e.note:
            lines += [e.note, ""]
        lines += [f"JSON: [`{s.name}/results.json`]({s.name}/results.json). ![{s.name}]({s.name}/results.png)", ""]
    path = out / "RESULTS.md"
    path.write_text("\n".join(lines))
    return path
