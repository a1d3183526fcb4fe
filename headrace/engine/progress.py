"""The live console view of a run: a progress bar with reward, throughput and staleness, and a
summary table at the end. Plain lines when the output is not a terminal (CI logs)."""

from __future__ import annotations

import math
import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def _fmt(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}g}"
    return str(value)


class ProgressView:
    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True):
        self.console = Console(stderr=False)
        self.live = enabled and self.console.is_terminal
        self.enabled = enabled
        self.total = total_steps
        self.every = max(1, total_steps // 20)
        self._progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self._task = self._progress.add_task("run", total=total_steps, completed=start_step, status="")

    def __enter__(self) -> ProgressView:
        if self.live:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self._progress.stop()

    @staticmethod
    def status(row: dict[str, Any]) -> str:
        return (
            f"reward {_fmt(row.get('reward/mean', float('nan')))}  "
            f"traj/s {_fmt(row.get('throughput/trajectories_per_s', 0.0))}  "
            f"tok/s {_fmt(row.get('throughput/tokens_per_s', 0.0))}  "
            f"stale {_fmt(row.get('staleness/mean', 0.0))}/{_fmt(row.get('staleness/max', 0.0))}"
        )

    def update(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.live:
            self._progress.update(self._task, completed=row["step"] + 1, status=self.status(row))
        elif row["step"] % self.every == 0 or row["step"] + 1 == self.total:
            print(f"step {row['step'] + 1}/{self.total}  {self.status(row)}", file=sys.stdout, flush=True)

    def summary(self, rows: list[dict[str, Any]], run_dir: str, wall_s: float) -> None:
        if not rows:
            self.console.print(f"nothing to train: the run in {run_dir} had already finished its steps")
            return
        first, last = rows[: max(1, len(rows) // 10)], rows[-max(1, len(rows) // 10) :]

        def mean(rs: list[dict[str, Any]], key: str) -> float:
            vals = [r[key] for r in rs if r.get(key) is not None and not math.isnan(r[key])]
            return sum(vals) / len(vals) if vals else float("nan")

        table = Table(title=f"run finished: {run_dir}")
        table.add_column("metric")
        table.add_column("first steps", justify="right")
        table.add_column("last steps", justify="right")
        for key in ("reward/mean", "throughput/trajectories_per_s", "throughput/tokens_per_s", "staleness/mean", "time/step"):
            table.add_row(key, _fmt(mean(first, key)), _fmt(mean(last, key)))
        self.console.print(table)
        dropped = sum(r.get("groups/dropped", 0) for r in rows)
        self.console.print(f"{len(rows)} steps in {wall_s:.1f} s; groups dropped: {int(dropped)}; metrics: {run_dir}/metrics.jsonl")
