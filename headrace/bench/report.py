"""What a bench writes: a console table, ``results.json`` (+ ``meta.json``), ``results.png``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from headrace.bench.harness import RunResult
from headrace.bench.scenario import Scenario

# (key, column title, format)
COLUMNS = [
    ("wall_s", "wall s", "{:.2f}"),
    ("ideal_s", "ideal s", "{:.2f}"),
    ("efficiency", "efficiency", "{:.3f}"),
    ("speedup_vs_sync", "vs sync", "{:.2f}x"),
    ("steps_per_s", "steps/s", "{:.3g}"),
    ("trajectories_per_s", "traj/s", "{:.4g}"),
    ("tokens_per_s", "tok/s", "{:.4g}"),
    ("learner_busy", "learner busy", "{:.0%}"),
    ("sampler_busy", "sampler busy", "{:.0%}"),
    ("staleness_mean", "stale mean", "{:.2f}"),
    ("staleness_max", "stale max", "{:.0f}"),
]
OVERHEAD_COLUMNS = [
    ("floor_trajectories_per_s", "floor traj/s", "{:.4g}"),
    ("overhead_ratio", "engine/floor", "{:.1%}"),
    ("trajectories_per_cpu_s", "traj/CPU-s", "{:.4g}"),
    ("floor_trajectories_per_cpu_s", "floor traj/CPU-s", "{:.4g}"),
    ("overhead_ratio_cpu", "engine/floor (CPU)", "{:.1%}"),
]


PERF_COLUMNS = [
    ("perf_mfu_train", "MFU train", "{:.1%}"),
    ("perf_train_flops_per_s", "train FLOP/s", "{:.3g}"),
    ("perf_mfu_sample", "MFU sample", "{:.1%}"),
    ("perf_sample_tokens_per_s", "sample tok/s", "{:.4g}"),
    # the fraction of wall time the torch sampler's decode loop ran (its device seconds), and the
    # mean rows per decode step; "sampler busy" above is the time any sample call was outstanding
    ("perf_sampler_busy", "decode busy", "{:.0%}"),
    ("perf_decode_rows", "decode rows", "{:.3g}"),
]


def fmt(value: Any, pattern: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return pattern.format(value)


def columns_for(results: list[RunResult]) -> list[tuple[str, str, str]]:
    extra = OVERHEAD_COLUMNS if any("overhead_ratio" in r.figures for r in results) else []
    reward = (
        [("final_reward", "final reward", "{:.3f}")] if any(r.figures.get("ideal_s") is None for r in results) else []
    )
    perf = PERF_COLUMNS if any("perf_mfu_train" in r.figures for r in results) else []
    return COLUMNS + extra + perf + reward


def console_table(scenario: Scenario, results: list[RunResult], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(
        title=f"headrace bench: {scenario.name}" + (f" ({scenario.description})" if scenario.description else "")
    )
    table.add_column("scheduler")
    cols = columns_for(results)
    for _, title, _ in cols:
        table.add_column(title, justify="right")
    for r in results:
        table.add_row(r.scheduler, *(fmt(r.figures.get(k), p) for k, _, p in cols))
    console.print(table)


def markdown_table(results: list[RunResult], cols: list[tuple[str, str, str]] | None = None) -> str:
    cols = cols or columns_for(results)
    lines = [
        "| scheduler | " + " | ".join(t for _, t, _ in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for r in results:
        lines.append(f"| `{r.scheduler}` | " + " | ".join(fmt(r.figures.get(k), p) for k, _, p in cols) + " |")
    return "\n".join(lines)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(out: Path, scenario: Scenario, results: list[RunResult], meta: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {r.scheduler: {k: _clean(v) for k, v in r.figures.items()} for r in results}
    (out / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    info = {"scenario": scenario.name, "description": scenario.description, "config": scenario.tree} | meta
    (out / "meta.json").write_text(json.dumps(info, indent=2, default=str) + "\n")


COLORS = {"sync": "#7f7f7f", "stream": "#1f77b4", "async": "#d62728"}


def plot(path: Path, scenario: Scenario, results: list[RunResult]) -> None:
    """Wall time against the ideal bound, throughput, and each run's busy timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig = plt.figure(figsize=(11, 3.2 + 1.0 * n), constrained_layout=True)
    grid = fig.add_gridspec(1 + n, 2, height_ratios=[3.0] + [1.0] * n)
    names = [r.scheduler for r in results]
    colors = [COLORS.get(s, "#2ca02c") for s in names]

    ax = fig.add_subplot(grid[0, 0])
    walls = [r.figures["wall_s"] for r in results]
    ax.bar(names, walls, color=colors, label="measured")
    ideals = [r.figures.get("ideal_s") for r in results]
    if any(ideals):  # none, or all 0 (a zero-latency model): nothing to mark
        ax.scatter(
            names,
            [i if i is not None else math.nan for i in ideals],
            marker="_",
            s=900,
            color="black",
            zorder=3,
            label="ideal bound",
        )
        ax.legend(loc="lower right", fontsize=8)
    for i, r in enumerate(results):
        eff, speed = r.figures.get("efficiency"), r.figures.get("speedup_vs_sync")
        label = " / ".join(x for x in (fmt(speed, "{:.2f}x"), fmt(eff, "eff {:.2f}")) if x != "-")
        ax.annotate(label, (i, walls[i]), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("wall time (s)")
    ax.set_title("wall time vs ideal (label: speedup over sync / efficiency)", fontsize=9)
    ax.margins(y=0.15)

    ax = fig.add_subplot(grid[0, 1])
    key = "trajectories_per_s"
    ax.bar(names, [r.figures[key] for r in results], color=colors)
    if any("floor_trajectories_per_s" in r.figures for r in results):
        ax.scatter(
            names,
            [r.figures.get("floor_trajectories_per_s", math.nan) for r in results],
            marker="_",
            s=900,
            color="black",
            zorder=3,
            label="bare-asyncio floor",
        )
        ax.legend(loc="lower right", fontsize=8)
    ax.set_ylabel("trajectories / s")
    ax.set_title("throughput", fontsize=9)

    horizon = max(walls)
    first = None
    for i, r in enumerate(results):
        ax = fig.add_subplot(grid[1 + i, :], sharex=first)
        first = first or ax
        for lane, (name, color) in enumerate((("learner", "#ff7f0e"), ("sampler", "#2ca02c"))):
            spans = r.spans.get(name, [])
            ax.broken_barh([(a, b - a) for a, b in spans], (lane + 0.1, 0.8), color=color)
        ax.set_yticks([0.5, 1.5], ["learner", "sampler"], fontsize=8)
        ax.set_ylim(0, 2)
        ax.set_xlim(0, horizon * 1.01)
        ax.set_ylabel(r.scheduler, rotation=0, ha="right", va="center", fontsize=9, fontweight="bold")
        if i < n - 1:
            ax.tick_params(labelbottom=False)
    assert first is not None  # results is not empty (max(walls) above)
    first.set_title(
        "busy timeline (learner: a training call running; sampler: a sample request being served)", fontsize=9
    )
    ax.set_xlabel("seconds since the run's actors started")
    fig.suptitle(f"{scenario.name}: {scenario.description}", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
