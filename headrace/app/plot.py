"""``headrace plot RUN_DIR``: reward, throughput and staleness over steps, from ``metrics.jsonl``.

Writes ``RUN_DIR/plot.png`` (or ``--out FILE``). Needs matplotlib (``pip install headrace[bench]``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from headrace.core.errors import ConfigError


def setup(parser: argparse.ArgumentParser) -> None:
    parser.description = "Plot a run directory's metrics.jsonl: reward, throughput and staleness over steps."
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds metrics.jsonl)")
    parser.add_argument("--out", metavar="FILE", help="PNG to write (default: RUN_DIR/plot.png)")
    parser.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    out = plot_run(Path(args.run_dir), Path(args.out) if args.out else None)
    print(f"wrote {out}")
    return 0


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"'{run_dir}' has no metrics.jsonl; pass the directory a run wrote (its --run-dir)")
    rows = []
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines):
                break  # a run killed mid-write leaves a torn last line: plot the rest
            raise ConfigError(f"{path} line {n} is not JSON; the file is damaged") from None
    if not rows:
        raise ConfigError(f"{path} has no steps yet; plot it once the run has reported a step")
    return rows


def _series(rows: list[dict[str, Any]], key: str) -> list[float]:
    out = []
    for r in rows:
        v = r.get(key)
        out.append(float(v) if isinstance(v, int | float) and v is not None else math.nan)
    return out


def _rolling(rows: list[dict[str, Any]], key: str, window: int) -> list[float]:
    """Σ key / Σ time/step over the last ``window`` steps: a rate that long steps weigh fairly."""
    amounts, times = _series(rows, key), _series(rows, "time/step")
    out = []
    for i in range(len(rows)):
        lo = max(0, i - window + 1)
        a, t = sum(amounts[lo : i + 1]), sum(times[lo : i + 1])
        out.append(a / t if t > 0 else math.nan)
    return out


def _binary(rows: list[dict[str, Any]]) -> bool:
    """Whether every reward seen is 0 or 1: then a min–max band only spans 0 to 1 and says nothing."""
    seen = {v for key in ("reward/min", "reward/max") for v in _series(rows, key) if not math.isnan(v)}
    return seen <= {0.0, 1.0}


def figure(rows: list[dict[str, Any]], title: str) -> Any:
    """The figure: reward, trajectories/s and tokens/s each on its own axes, and staleness only
    when some data was off-policy (a sync run's would be an empty panel)."""
    import matplotlib.pyplot as plt

    steps = [r.get("step", i) for i, r in enumerate(rows)]
    stale = any(v > 0 for v in _series(rows, "staleness/max") if not math.isnan(v))
    panels = 4 if stale else 3
    fig, axes = plt.subplots(panels, 1, figsize=(8, 2.2 * panels + 0.6), sharex=True, constrained_layout=True)

    ax = axes[0]
    ax.plot(steps, _series(rows, "reward/mean"), color="#1f77b4", label="reward/mean")
    if not _binary(rows):
        lo, hi = _series(rows, "reward/min"), _series(rows, "reward/max")
        ax.fill_between(steps, lo, hi, color="#1f77b4", alpha=0.15, label="min–max")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_ylabel("reward (mean)")

    # over a rolling window, not per step: with async two steps can finish almost together
    window = max(1, len(rows) // 20)
    for ax, key, color, label in (
        (axes[1], "throughput/trajectories", "#2ca02c", "trajectories / s"),
        (axes[2], "throughput/action_tokens", "#ff7f0e", "tokens / s"),
    ):
        ax.plot(steps, _rolling(rows, key, window), color=color)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    axes[1].set_title(f"throughput over a {window}-step window", fontsize=9, loc="left")

    if stale:
        ax = axes[3]
        ax.plot(steps, _series(rows, "staleness/mean"), color="#d62728", label="mean")
        ax.plot(steps, _series(rows, "staleness/max"), color="#d62728", ls="--", alpha=0.6, label="max")
        ax.set_ylabel("staleness (steps)")
        ax.legend(fontsize=8, loc="best")
    else:
        title += "; staleness 0 throughout (on-policy)"
    axes[-1].set_xlabel("step")
    fig.suptitle(title, fontsize=10)
    return fig


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("headrace plot needs matplotlib: pip install 'headrace[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(run_dir)
    fig = figure(rows, f"{run_dir}: {len(rows)} steps")
    out = out or run_dir / "plot.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
