"""The live console view of a run: once it has started, the run directory and a legend, then one line
of at most 80 columns (progress, reward, throughput, staleness, ETA), and a summary table at the end.
Plain lines when the output is not a terminal (CI logs). ``run_with_progress`` is a run with this
view, as ``headrace run`` shows it, for a script."""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import Progress, TextColumn
from rich.table import Table

from headrace.core.trace import Event, RunStarted, StepPublished, Tracer, fan_out

if TYPE_CHECKING:
    from headrace.core.types import RLDataset
    from headrace.run.config import RunConfig
    from headrace.run.train import RunSummary

WIDTH = 80
RATE_WINDOW = 10  # steps: async steps can finish almost together, so one step's rate means little
LEGEND = "stale m/M = updates between sampling and training (mean/max), 0 = on-policy"


def num(value: Any) -> str:
    """A number in at most 6 characters: 0.423, -12.3, 15.5k, 2.1M."""
    if not isinstance(value, int | float) or math.isnan(value):
        return "nan" if isinstance(value, float) else str(value)
    if value == 0 or math.isinf(value):
        return f"{value:g}"
    if abs(value) < 1e-3:
        return f"{value:.0e}"
    for scale, suffix in ((1, ""), (1e3, "k"), (1e6, "M"), (1e9, "G"), (1e12, "T")):
        text = f"{value / scale:.3g}"
        if "e" not in text and abs(float(text)) < 1000:
            return text + suffix
    return f"{value:.0e}"


def duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s < 100 * 3600 else f"{s // 3600}h"


def rates(rows: Iterable[dict[str, Any]]) -> tuple[float, float]:
    """(trajectories/s, tokens/s) over ``rows``: their totals over their total time. A mean of
    per-step rates would let one step that finished right after another dominate."""
    trajectories = tokens = seconds = 0.0
    for r in rows:
        trajectories += r.get("throughput/trajectories") or 0.0
        tokens += r.get("throughput/action_tokens") or 0.0
        seconds += r.get("time/step") or 0.0
    return (trajectories / seconds, tokens / seconds) if seconds > 0 else (math.nan, math.nan)


def no_update_note(row: dict[str, Any]) -> str | None:
    """What to say when no group of the step was trained."""
    filtered, dropped = int(row.get("groups/filtered") or 0), int(row.get("groups/dropped") or 0)
    if row.get("groups/trained", 1) or not filtered + dropped:
        return None
    if not dropped:
        return f"no update: all {filtered} groups had equal rewards"
    return f"no update: {filtered} groups equal rewards, {dropped} dropped"


def fit(parts: list[tuple[int, str]], width: int) -> str:
    """Join ``(priority, text)`` parts, leaving out the least important until the line fits."""
    kept = list(parts)
    while len("  ".join(t for _, t in kept)) > width and len(kept) > 1:
        kept.remove(max(kept, key=lambda p: p[0]))
    return "  ".join(t for _, t in kept)[:width]


class ProgressView:
    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        run_dir: str | None = None,
        console: Console | None = None,
    ):
        self.console = console or Console(stderr=False)
        self.live = enabled and self.console.is_terminal
        self.enabled = enabled
        self.total = total_steps
        self.run_dir = run_dir
        self.every = max(1, total_steps // 20)
        self.recent: deque[dict[str, Any]] = deque(maxlen=RATE_WINDOW)
        # this process's totals, from every row (the summary's rows are bounded)
        self.seen = 0
        self.seconds = self.trajectories = self.tokens = 0.0
        self.no_update_steps = 0
        self._progress = Progress(TextColumn("{task.fields[line]}", markup=False), console=self.console)
        self._task = self._progress.add_task("run", total=total_steps, completed=start_step, line="")
        self._begun = False

    def __enter__(self) -> ProgressView:
        return self

    def begin(self) -> None:
        """The run directory and the legend, then the live line: once the run has started, so a
        run refused at set-up prints its refusal alone."""
        if self._begun:
            return
        self._begun = True
        if self.run_dir:
            self._print(f"headrace: run dir {self.run_dir} (config.json, metrics.jsonl, log.jsonl, checkpoints/)")
        if self.enabled:
            self._print(LEGEND)
        if self.live:
            self._progress.start()

    def __exit__(self, *exc: object) -> None:
        if self.live and self._begun:
            self._progress.stop()

    def _print(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def line(self, row: dict[str, Any], width: int = WIDTH, bar: bool = True) -> str:
        """The live line for ``row``, at most ``width`` columns; the bar takes what is left."""
        done = row["step"] + 1
        left = self.total - done
        eta = "done" if left <= 0 else f"ETA {duration(self.seconds / self.seen * left) if self.seen else '?'}"
        traj_s, tok_s = rates(self.recent or [row])
        note = no_update_note(row)
        parts = [(0, f"step {done}/{self.total}"), (1, f"reward {num(row.get('reward/mean', math.nan))}")]
        if note:
            parts.append((2, note))
        else:
            parts += [
                (4, f"{num(traj_s)} traj/s"),
                (5, f"{num(tok_s)} tok/s"),
                (3, f"stale {num(row.get('staleness/mean', 0.0))}/{num(row.get('staleness/max', 0.0))}"),
            ]
        parts.append((1, eta))
        text = fit(parts, width)
        cells = min(width - len(text), 20)  # the bar and a space take a separator's place
        if not bar or cells < 5:
            return text
        filled = round(cells * min(1.0, done / max(1, self.total)))
        head, _, tail = text.partition("  ")
        return f"{head} {'━' * filled}{'─' * (cells - filled)} {tail}".rstrip()

    def _count(self, row: dict[str, Any]) -> None:
        self.seen += 1
        self.seconds += row.get("time/step") or 0.0
        self.trajectories += row.get("throughput/trajectories") or 0.0
        self.tokens += row.get("throughput/action_tokens") or 0.0
        self.no_update_steps += no_update_note(row) is not None
        self.recent.append(row)

    def __call__(self, event: Event) -> None:
        """The display is a tracer: it follows the run's events."""
        if isinstance(event, StepPublished):
            self.update(event.row)
        elif isinstance(event, RunStarted):
            self.begin()
            if self.live:
                self._progress.update(self._task, completed=event.start_step)

    def update(self, row: dict[str, Any]) -> None:
        self._count(row)
        self.begin()
        if not self.enabled:
            return
        if self.live:
            width = min(WIDTH, self.console.width)
            self._progress.update(self._task, completed=row["step"] + 1, line=self.line(row, width))
        elif row["step"] % self.every == 0 or row["step"] + 1 == self.total:
            print(self.line(row, bar=False), file=sys.stdout, flush=True)

    def summary(self, run: RunSummary) -> None:
        """This process's steps (a resumed run's earlier ones are in metrics.jsonl), from the rows
        it saw or kept in memory: the file is never read back, however long the run."""
        if run.trained <= 0:
            self.console.print(
                f"nothing to train: the run in {run.run_dir} had already finished its steps"
                if run.start_step >= self.total
                else f"no step finished; the run is in {run.run_dir}"
            )
            return
        if not self.seen:  # not wired to the run's on_step: the rows the summary kept
            for row in {r["step"]: r for r in [*run.first_rows, *run.metrics]}.values():
                self._count(row)
        window = min(max(1, run.trained // 10), len(run.first_rows), len(run.metrics))
        first, last = run.first_rows[:window], run.metrics[-window:]

        def mean(rs: list[dict[str, Any]], key: str) -> float:
            vals = [r[key] for r in rs if r.get(key) is not None and not math.isnan(r[key])]
            return sum(vals) / len(vals) if vals else float("nan")

        table = Table(title=f"run finished: {run.run_dir}")
        table.add_column("metric")
        steps = f"{window} steps" if window > 1 else "step"
        table.add_column(f"first {steps}", justify="right")
        table.add_column(f"last {steps}", justify="right")
        table.add_row("reward/mean", num(mean(first, "reward/mean")), num(mean(last, "reward/mean")))
        (traj_a, tok_a), (traj_b, tok_b) = rates(first), rates(last)
        table.add_row("trajectories/s", num(traj_a), num(traj_b))
        table.add_row("tokens/s", num(tok_a), num(tok_b))
        for key in ("staleness/mean", "time/step"):
            table.add_row(key, num(mean(first, key)), num(mean(last, key)))
        # model FLOPs utilisation, where the backend counts FLOPs (torch)
        for key in (
            "perf/mfu_train",
            "perf/mfu_sample",
            "perf/train_flops_per_s",
            "perf/sample_tokens_per_s",
            "perf/sampler_busy",
        ):
            if any(key in r for r in [*first, *last]):
                table.add_row(key, num(mean(first, key)), num(mean(last, key)))
        self.console.print(table)
        resumed = ""
        if run.start_step:
            resumed = f" (steps {run.start_step + 1}-{run.steps}, resumed after step {run.start_step})"
        overall = (
            f"{self.trajectories:,.0f} trajectories in {self.seconds:.1f} s of training: "
            f"{num(self.trajectories / self.seconds)} traj/s, {num(self.tokens / self.seconds)} tok/s"
            if self.seconds > 0
            else ""
        )
        idle = (
            f"; {self.no_update_steps} steps applied no update (every group had equal rewards or was dropped)"
            if self.no_update_steps
            else ""
        )
        self._print(
            f"{run.trained} steps in {run.wall_s:.1f} s{resumed}; {overall}; groups dropped: "
            f"{run.dropped_groups}{idle}; metrics: {run.run_dir}/metrics.jsonl"
        )


def run_with_progress(
    config: RunConfig, *, dataset: RLDataset | None = None, tracer: Tracer | None = None
) -> RunSummary:
    """Train ``config`` as ``headrace run`` does: the run directory first (``runs/ENV-...`` unless
    ``config.run_dir`` names one), the live line, the summary table; the first Ctrl-C (or SIGTERM)
    checkpoints and stops, ``summary.stopped_by`` names it. ``tracer`` sees the run's events
    beside the display. Blocks: call it from a script, not from a running event loop (there,
    ``await headrace.train(...)``). Errors are raised as is."""
    import anyio

    from headrace.run.rundir import default_run_dir
    from headrace.run.train import train

    if config.run_dir is None:
        config = config.model_copy(update={"run_dir": str(default_run_dir(config))})
    with ProgressView(config.steps, enabled=config.progress, run_dir=config.run_dir) as view:
        both = fan_out(view, tracer)
        summary = anyio.run(lambda: train(config, dataset=dataset, tracer=both, handle_signals=True))
    view.summary(summary)
    if summary.stopped_by:
        print(
            f"headrace: stopped by {summary.stopped_by} after step {summary.steps}; "
            f"continue with --resume --run-dir {summary.run_dir}",
            file=sys.stderr,
        )
    return summary
