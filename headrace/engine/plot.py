"""``headrace plot RUN_DIR``: reward, throughput and staleness over steps, from ``metrics.jsonl``.

Writes ``RUN_DIR/plot.png`` (or ``--out FILE``). Needs matplotlib (``pip install headrace[bench]``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from headrace.engine.config import ConfigError


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


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("headrace plot needs matplotlib: pip install 'headrace[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(run_dir)
    steps = [r.get("step", i) for i, r in enumerate(rows)]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True, constrained_layout=True)

    ax = axes[0]
    mean = _series(rows, "reward/mean")
    ax.plot(steps, mean, color="#1f77b4", label="reward/mean")
    lo, hi = _series(rows, "reward/min"), _series(rows, "reward/max")
    if any(not math.isnan(v) for v in lo):
        ax.fill_between(steps, lo, hi, color="#1f77b4", alpha=0.15, label="min–max")
    ax.set_ylabel("reward")
    ax.legend(fontsize=8, loc="lower right")

    # over a rolling window, not per step: with async two steps can finish almost together
    ax = axes[1]
    window = max(1, len(rows) // 20)
    ax.plot(steps, _rolling(rows, "throughput/trajectories", window), color="#2ca02c", label=f"trajectories/s ({window}-step window)")
    ax.set_ylabel("trajectories / s")
    twin = ax.twinx()
    twin.plot(steps, _rolling(rows, "throughput/action_tokens", window), color="#ff7f0e", alpha=0.8, label="tokens/s")
    twin.set_ylabel("tokens / s")
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="lower right")

    ax = axes[2]
    ax.plot(steps, _series(rows, "staleness/mean"), color="#d62728", label="staleness mean")
    ax.plot(steps, _series(rows, "staleness/max"), color="#d62728", ls="--", alpha=0.6, label="staleness max")
    ax.set_ylabel("steps behind")
    ax.set_xlabel("step")
    ax.legend(fontsize=8, loc="upper right")

    fig.suptitle(f"{run_dir}: {len(rows)} steps", fontsize=10)
    out = out or run_dir / "plot.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
