"""A newcomer's first hour: --version, argparse's own errors in headrace's style, the live line
and the summary's throughput, a described env listing, and plots without empty or stacked panels."""

from __future__ import annotations

import io
import json
import re
from importlib.metadata import version

import pytest
from rich.console import Console

from headrace.app import progress
from headrace.app.cli import main
from headrace.plugins import registry
from headrace.run.train import RunSummary

pytestmark = pytest.mark.timeout(60)


def test_version_names_the_installed_package(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"headrace {version('headrace')}"


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["rnu"], ["unknown command 'rnu'", "Did you mean 'run'?"]),
        (["run", "--evn", "arithmetic"], ["unknown option '--evn' for `headrace run`", "Did you mean '--env'?"]),
        (["run", "--backend", "sim", "--sheduler", "async"], ["Did you mean '--scheduler'?"]),
        (["run", "--steps", "abc"], ["--steps takes a whole number, not 'abc'", "`--steps 3`"]),
        (["run", "--lr", "fast"], ["--lr takes a number, not 'fast'"]),
        (["run", "--steps"], ["--steps needs a value"]),
        (["run", "steps=3"], ["Did you mean `--set steps=3`?"]),
        ([], ["needs a command: one of run, envs"]),
        (["plot"], ["`headrace plot` needs RUN_DIR"]),
        (["envs", "--verbose"], ["unknown option '--verbose' for `headrace envs`"]),
    ],
)
def test_argparse_errors_are_one_paragraph_with_the_closest_name(argv, fragments, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("headrace: error: ") and err.count("\n") == 1, err  # one paragraph, one line
    assert "usage:" not in err and "Traceback" not in err and not captured.out
    for fragment in fragments:
        assert fragment in err


def _row(step: int, seconds: float, trajectories: float = 512.0, **more) -> dict:
    return {
        "step": step,
        "time/step": seconds,
        "throughput/trajectories": trajectories,
        "throughput/action_tokens": 4 * trajectories,
        "reward/mean": 0.5,
        "staleness/mean": 0.0,
        "throughput/trajectories_per_s": trajectories / seconds,
        "throughput/tokens_per_s": 4 * trajectories / seconds,
        "groups/trained": 32,
        **more,
    }


def test_summary_throughput_is_total_trajectories_over_total_time(capsys):
    # two 5 s steps, then one that finished 1 ms after its neighbour (async): the per-step
    # rates are 102, 102 and 512,000 traj/s, whose mean (~171k) says nothing about the run
    rows = [_row(0, 5.0), _row(1, 5.0), _row(2, 0.001)]
    view = progress.ProgressView(3, enabled=False)
    for row in rows:
        view.update(row)
    view.summary(RunSummary("runs/x", steps=3, wall_s=11.0, metrics=rows, first_rows=rows))
    out = " ".join(capsys.readouterr().out.split())
    assert "1,536 trajectories in 10.0 s of training: 154 traj/s, 614 tok/s" in out  # 1536 / 10.001
    assert "171k" not in out and "1.71e+05" not in out


EXTREME = {
    "step": 999_998,
    "reward/mean": -12345.678,
    "staleness/mean": 1234.5,
    "staleness/max": 99999.0,
    "throughput/trajectories": 1e12,
    "throughput/action_tokens": 1e15,
    "time/step": 1e-9,
    "groups/trained": 3,
    "groups/filtered": 0,
}
ALL_FILTERED = {
    "step": 11,
    "reward/mean": 0.0,
    "staleness/mean": 0.0,
    "staleness/max": 0.0,
    "throughput/trajectories": 512.0,
    "throughput/action_tokens": 2048.0,
    "time/step": 0.4,
    "groups/trained": 0,
    "groups/filtered": 32,
    "groups/dropped": 0,
}


def _live_lines(total: int, rows: list[dict]) -> list[str]:
    """What a terminal 200 columns wide shows of the live display, control codes removed."""
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=200, color_system=None)
    with progress.ProgressView(total, console=console, run_dir="runs/x") as view:
        for row in rows:
            view.update(row)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())
    return [line for line in re.split(r"[\r\n]", text) if line.strip()]


@pytest.mark.parametrize(
    ("total", "row"),
    [(1_000_000, EXTREME), (120, ALL_FILTERED), (120, {**EXTREME, "step": 3, "reward/mean": float("nan")})],
)
def test_live_line_fits_80_columns_with_an_eta(total, row):
    lines = _live_lines(total, [row])
    live = [line for line in lines if line.startswith("step ")]
    assert live, lines
    assert max(map(len, live)) <= 80, live
    assert all("ETA " in line for line in live)


def test_live_display_names_the_run_dir_explains_stale_and_says_when_nothing_trained():
    lines = _live_lines(120, [ALL_FILTERED])
    assert lines[0].startswith("headrace: run dir runs/x")
    assert any(line.startswith("stale m/M = ") for line in lines[:2])
    assert any("no update: all 32 groups had equal rewards" in line for line in lines)


def test_plain_lines_fit_80_columns_too(capsys):
    view = progress.ProgressView(1_000_000)  # captured stdout is not a terminal: plain lines
    view.update({**EXTREME, "step": 0})
    out = capsys.readouterr().out.splitlines()
    assert out and max(map(len, out)) <= 80, out


def test_envs_listing_describes_each_env(capsys):
    assert main(["envs"]) == 0
    lines = dict(line.split(maxsplit=1) for line in capsys.readouterr().out.splitlines())
    for name in ("arithmetic", "guess_number", "faulty", "flaky_arithmetic"):
        assert len(lines.get(name, "")) > 10, lines
    assert lines["faulty"].startswith("Test env") and lines["flaky_arithmetic"].startswith("Test env")


def test_a_lazy_entry_that_cannot_load_is_described_not_fatal():
    reg = registry.Registry("env", builtins={"broken": "headrace_no_such_module:make_dataset"})
    assert reg.describe("broken").startswith("(cannot load: ModuleNotFoundError")


def _write_run(path, rows):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _figure(run_dir, monkeypatch):
    """The figure plot_run draws, kept open instead of closed."""
    import matplotlib.pyplot as plt

    from headrace.app.plot import plot_run

    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    plot_run(run_dir)
    assert (run_dir / "plot.png").stat().st_size > 0
    return kept[0]


def test_plot_of_a_sync_run_with_0_1_rewards(tmp_path, monkeypatch):
    rows = [
        {**_row(i, 1.0 + i % 3), "reward/min": 0.0, "reward/max": 1.0, "reward/mean": i / 40, "staleness/max": 0.0}
        for i in range(40)
    ]
    _write_run(tmp_path / "sync", rows)
    fig = _figure(tmp_path / "sync", monkeypatch)
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert labels == ["reward (mean)", "trajectories / s", "tokens / s"]  # no staleness panel, no twin axes
    assert not fig.axes[0].collections  # no min-max band spanning 0..1
    assert [len(ax.get_lines()) for ax in fig.axes[1:]] == [1, 1]


def test_plot_of_an_async_run_with_graded_rewards(tmp_path, monkeypatch):
    rows = [
        {**_row(i, 1.0), "reward/min": 0.1, "reward/max": 0.9, "staleness/mean": 0.5, "staleness/max": 1.0}
        for i in range(40)
    ]
    _write_run(tmp_path / "async", rows)
    fig = _figure(tmp_path / "async", monkeypatch)
    assert [ax.get_ylabel() for ax in fig.axes][-1] == "staleness (steps)"
    assert len(fig.axes) == 4 and fig.axes[0].collections  # the band, for rewards that are not 0/1
