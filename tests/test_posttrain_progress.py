"""The live line of the post-training commands (``posttrain/progress.py``)."""

from __future__ import annotations

import io

from rich.console import Console

from headrace.posttrain.progress import StepProgress


def test_the_line_names_the_recipes_figures_in_80_columns():
    view = StepProgress("dpo", enabled=False)
    view.begin(0, 50)
    for k in range(5):
        view.row({"step": k, "wall_s": 2.0 * (k + 1), "dpo/loss": 0.6 - 0.1 * k, "dpo/pairs": 8.0})
    view.row({"step": 5, "wall_s": 12.0, "dpo/loss": 0.05, "dpo/pairs": 8.0, "test/accuracy": 0.75})
    line = view.line({"step": 5, "dpo/loss": 0.05})
    assert line.startswith("step 6/50 ━") and len(line) <= 80
    assert "loss 0.05" in line and "test acc 0.75" in line and "4 pairs/s" in line
    assert "ETA 1m28s" in line  # 2 s a step, 44 steps left
    assert view.line({"step": 49, "dpo/loss": 0.01}, bar=False).endswith("done")


def test_a_terminal_gets_the_live_line_and_a_log_plain_lines(capsys):
    out = io.StringIO()
    live = StepProgress("sft", console=Console(file=out, force_terminal=True, width=100))
    live.begin(0, 3)
    for k in range(3):
        live.row({"step": k, "wall_s": k + 1.0, "sft/train_nll": 1.0, "sft/loss_tokens": 100.0})
    live.end()
    assert "step 3/3" in out.getvalue() and "100 tok/s" in out.getvalue()
    plain = StepProgress("sdft", console=Console(file=io.StringIO(), force_terminal=False))
    plain.begin(0, 40)
    for k in range(40):
        plain.row({"step": k, "wall_s": k + 1.0, "sdft/topk_ce": 2.0, "sdft/sample_tokens": 10.0})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 21 and lines[-1].startswith("step 40/40") and "ce 2" in lines[-1]  # every 2nd step, the last
