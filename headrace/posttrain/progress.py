"""The live line of ``headrace sft`` / ``dpo`` / ``sdft``, as ``headrace run`` shows its own
(``headrace/app/progress.py``: its number format, its bar, the same 80 columns): the step, the
recipe's training loss, the last held-out figure, throughput and the ETA. Plain lines, every
twentieth of the run, when the output is not a terminal."""

from __future__ import annotations

import math
import sys
from collections import deque
from typing import Any

from rich.console import Console
from rich.progress import Progress, TextColumn

from headrace.app.progress import WIDTH, duration, fit, num

# recipe -> (label, metric) of the training loss, the held-out figure, and what a step processes
FIGURES: dict[str, dict[str, tuple[str, str]]] = {
    "sft": {"loss": ("nll", "sft/train_nll"), "test": ("test", "test/nll"), "count": ("tok", "sft/loss_tokens")},
    "dpo": {"loss": ("loss", "dpo/loss"), "test": ("test acc", "test/accuracy"), "count": ("pairs", "dpo/pairs")},
    "sdft": {"loss": ("ce", "sdft/topk_ce"), "test": ("test", "test/nll"), "count": ("tok", "sdft/sample_tokens")},
}
WINDOW = 10  # steps the rate is taken over


class StepProgress:
    """Follows a post-training run's rows (``Session.view``): ``begin`` once the plan is known,
    ``row`` for each row written, ``end`` when it finishes."""

    def __init__(self, recipe: str, enabled: bool = True, console: Console | None = None):
        self.figures = FIGURES[recipe]
        self.console = console or Console()
        self.enabled = enabled
        self.live = enabled and self.console.is_terminal
        self.total = self.start = 0
        self.every = 1
        self.test: float | None = None
        self.last_wall = 0.0
        self.recent: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (seconds, count) a step
        self.seconds = 0.0
        self.seen = 0
        self._progress = Progress(TextColumn("{task.fields[line]}", markup=False), console=self.console)
        self._task: Any = None

    def begin(self, start: int, total: int) -> None:
        self.start, self.total, self.every = start, total, max(1, total // 20)
        if self.live:
            self._task = self._progress.add_task("steps", total=total, completed=start, line="")
            self._progress.start()

    def end(self) -> None:
        if self.live and self._task is not None:
            self._progress.stop()

    def row(self, row: dict[str, Any]) -> None:
        wall = float(row.get("wall_s") or 0.0)
        seconds, self.last_wall = max(0.0, wall - self.last_wall), wall
        self.recent.append((seconds, float(row.get(self.figures["count"][1]) or 0.0)))
        self.seconds += seconds
        self.seen += 1
        if self.figures["test"][1] in row:
            self.test = row[self.figures["test"][1]]
        if not self.enabled:
            return
        if self.live:
            width = min(WIDTH, self.console.width)
            self._progress.update(self._task, completed=row["step"] + 1, line=self.line(row, width))
        elif row["step"] % self.every == 0 or row["step"] + 1 == self.total:
            print(self.line(row, bar=False), file=sys.stdout, flush=True)

    def line(self, row: dict[str, Any], width: int = WIDTH, bar: bool = True) -> str:
        """At most ``width`` columns: the step, the bar in what is left, then the figures."""
        done = row["step"] + 1
        left = self.total - done
        eta = "done" if left <= 0 else f"ETA {duration(self.seconds / self.seen * left) if self.seen else '?'}"
        seconds = sum(s for s, _ in self.recent)
        rate = sum(c for _, c in self.recent) / seconds if seconds > 0 else math.nan
        label, key = self.figures["loss"]
        parts = [(0, f"step {done}/{self.total}"), (1, f"{label} {num(row.get(key, math.nan))}")]
        if self.test is not None:
            parts.append((2, f"{self.figures['test'][0]} {num(self.test)}"))
        parts += [(3, f"{num(rate)} {self.figures['count'][0]}/s"), (1, eta)]
        text = fit(parts, width)
        cells = min(width - len(text), 20)
        if not bar or cells < 5:
            return text
        filled = round(cells * min(1.0, done / max(1, self.total)))
        head, _, tail = text.partition("  ")
        return f"{head} {'━' * filled}{'─' * (cells - filled)} {tail}".rstrip()
