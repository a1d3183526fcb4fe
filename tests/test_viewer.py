"""Rollout samples (``RUN_DIR/rollouts/step_NNNNNN.jsonl``) and the ``headrace view`` page, the latter
checked in a real headless Chromium: the steps and completions render, and markup in a completion
is shown as text, never run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import pytest
from helpers import run_sim

from headrace.app.cli import main
from headrace.core.types import GroupKey, SampledTokens, StopReason, Trajectory, Transition
from headrace.tokenizers.char import CharTokenizer
from headrace.viewer import RolloutSampleWriter
from headrace.viewer.page import collect, render
from headrace.viewer.samples import MAX_FILE_BYTES, pick_members

HOSTILE = "<script>document.title='PWNED'</script><img src=x onerror=\"document.title='PWNED'\">"
HOSTILE_ID = 10**6  # a token id the test tokenizer decodes to HOSTILE


class Tok(CharTokenizer):
    def decode(self, tokens):
        return "".join(HOSTILE if t == HOSTILE_ID else super(Tok, self).decode([t]) for t in tokens)


def traj(tok, turns, version=3, stop=StopReason.STOP):
    """A trajectory from (observation, action) texts; each observation is the whole prompt so far."""
    transitions = []
    for obs, act in turns:
        ids = tok.encode(act) if isinstance(act, str) else act
        transitions.append(Transition(tok.encode(obs), SampledTokens(ids, [0.0] * len(ids), stop, version), 0.0, False))
    return Trajectory(transitions, stop)


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_pick_members_is_best_then_worst_and_ties_go_to_the_lower_index():
    assert pick_members([0.0, 1.0, 0.5, 1.0, 0.0], 2) == [1, 0]
    assert pick_members([0.0, 1.0, 0.5, 1.0, 0.0], 4) == [1, 0, 3, 4]
    assert pick_members([float("nan"), 0.2], 2) == [1, 0]
    assert pick_members([1.0], 3) == [0]


def test_writer_samples_the_first_groups_whatever_order_they_finish_in(tmp_path):
    tok = CharTokenizer()
    writer = RolloutSampleWriter(tmp_path, per_step=4, tokenizer=tok)  # 2 groups x best and worst

    def group(i):
        members = [traj(tok, [("1+2=", str(i + m))]) for m in range(3)]
        return GroupKey(7, i), members, [0.0, 1.0, 0.5], [-1.0, 1.0, 0.0]

    for i in (3, 1, 2, 0):  # async schedulers finish groups in any order
        writer.write(7, [group(i)])
    rows = lines(tmp_path / "rollouts" / "step_000007.jsonl")
    assert sorted((r["group"], r["member"]) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    best = next(r for r in rows if r["group"] == 1 and r["member"] == 1)
    assert (best["prompt"], best["completion"], best["reward"], best["advantage"]) == ("1+2=", "2", 1.0, 1.0)
    assert (best["policy_version"], best["stop_reason"], best["batch"]) == (3, "stop", 7)
    assert (best["prompt_tokens"], best["completion_tokens"], best["group_size"]) == (4, 1, 3)
    assert writer.failures == 0
    odd = RolloutSampleWriter(tmp_path / "odd", per_step=3, tokenizer=tok)
    assert odd.write(7, [group(i) for i in range(4)]) == 3  # best and worst of group 0, best of group 1


def test_multi_turn_records_each_turns_new_observation_and_action(tmp_path):
    tok = CharTokenizer()
    t = traj(tok, [("2+2=", "5"), ("2+2=5 no, again:", "4")])
    RolloutSampleWriter(tmp_path, per_step=1, tokenizer=tok).write(0, [(GroupKey(0, 0), [t], [1.0])])
    (row,) = lines(tmp_path / "rollouts" / "step_000000.jsonl")
    assert [(x["observation"], x["action"]) for x in row["turns"]] == [("2+2=", "5"), (" no, again:", "4")]
    assert (row["prompt"], row["completion"], row["advantage"]) == ("2+2=", "5 no, again:4", None)


def test_a_step_file_is_bounded_and_a_new_writer_replaces_a_crashed_runs_lines(tmp_path):
    tok = CharTokenizer()
    long = traj(tok, [("q", "1" * 3000)])
    writer = RolloutSampleWriter(tmp_path, per_step=400, tokenizer=tok)
    writer.write(0, [(GroupKey(0, i), [long, long], [0.0, 1.0]) for i in range(200)])
    path = tmp_path / "rollouts" / "step_000000.jsonl"
    assert 0 < path.stat().st_size <= MAX_FILE_BYTES
    assert all(len(r["completion"]) == 3000 for r in lines(path))  # only whole lines
    RolloutSampleWriter(tmp_path, per_step=2, tokenizer=tok).write(0, [(GroupKey(0, 0), [long, long], [0.0, 1.0])])
    assert len(lines(path)) == 2  # the resumed run's step, not the old lines plus the new


def test_a_failed_write_is_counted_never_raised(tmp_path):
    (tmp_path / "rollouts").write_text("a file where the directory should be")
    tok = CharTokenizer()
    writer = RolloutSampleWriter(tmp_path, per_step=2, tokenizer=tok)
    assert writer.write(0, [(GroupKey(0, 0), [traj(tok, [("q", "1")])], [1.0])]) == 0
    assert writer.failures == 1


def test_the_page_embeds_untrusted_text_so_it_cannot_close_or_open_a_tag(tmp_path):
    tok = Tok()
    t = traj(tok, [("q", [HOSTILE_ID])])
    RolloutSampleWriter(tmp_path, per_step=1, tokenizer=tok).write(0, [(GroupKey(0, 0), [t], [1.0])])
    page = render(collect(tmp_path))
    assert "PWNED" in page and HOSTILE not in page
    assert "</script><img" not in page and "<img" not in page
    assert page.count("<script") == 2  # the data block and the page's own script, nothing else


def test_view_command_writes_the_page_and_refuses_a_directory_that_is_no_run(tmp_path, capsys):
    assert main(["view", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["view", str(tmp_path)]) == 2
    assert "neither metrics.jsonl nor rollouts/" in capsys.readouterr().err


async def _run_with_samples(tmp_path, monkeypatch, steps):
    """A short sim run that writes its own samples (``log_rollouts``), plus one hostile completion."""
    await run_sim(tmp_path, steps=steps, batch_size=4, group_size=4, log_rollouts=4)
    run_dir = tmp_path / "run"
    assert len(lines(run_dir / "rollouts" / "step_000000.jsonl")) == 4  # 2 groups x best and worst
    # one hostile completion in the last step, as a model could write it
    writer = RolloutSampleWriter(tmp_path / "extra", per_step=4, tokenizer=Tok())
    hostile = traj(writer.tokenizer, [("1+1=", [HOSTILE_ID])])
    writer.write(steps - 1, [(GroupKey(steps - 1, 0), [hostile], [0.25])])
    with open(run_dir / "rollouts" / f"step_{steps - 1:06d}.jsonl", "a") as f:
        f.write(writer.path(steps - 1).read_text())
    return run_dir, writer


def _chromium():
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        if os.environ.get("CI"):
            pytest.fail(
                "chromium is not installed: CI must run the viewer's browser test (scripts/setup.sh "
                "VENV browser installs it with apt-get)"
            )
        pytest.skip(
            "chromium is not installed (`bash scripts/setup.sh .venv browser` installs it); in CI this test runs"
        )
    return found


def _headless(chromium, tmp_path, *args, url):
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ]
    done = subprocess.run([chromium, *flags, *args, url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_view_page_renders_steps_and_completions_in_headless_chromium(tmp_path, monkeypatch, capsys):
    chromium = _chromium()
    run_dir, writer = await _run_with_samples(tmp_path, monkeypatch, steps=6)
    assert writer.failures == 0
    assert main(["view", str(run_dir)]) == 0
    assert "6 steps" in capsys.readouterr().out
    page = run_dir / "view.html"
    sample = lines(run_dir / "rollouts" / "step_000002.jsonl")[0]

    started = time.monotonic()
    dom = _headless(chromium, tmp_path, "--dump-dom", url=f"{page.as_uri()}#step=2")
    assert 'data-rendered="yes"' in dom, dom[-2000:]
    assert len(re.findall(r"<li [^>]*data-step=", dom)) == 6
    assert re.search(r'class="current"[^>]*data-step="2"|data-step="2"[^>]*class="current"', dom)
    assert '<h2 id="step-title">step 2</h2>' in dom
    assert f"{sample['prompt']}</pre>" in dom and "reward " in dom

    dom = _headless(chromium, tmp_path, "--dump-dom", url=f"{page.as_uri()}#step=5")
    assert "&lt;script&gt;document.title='PWNED'&lt;/script&gt;&lt;img src=x" in dom  # shown, as text
    assert "<title>headrace · run</title>" in dom and "PWNED</title>" not in dom  # and never run
    assert "<img" not in dom

    # the search box and the reward filter, set from the link
    dom = _headless(chromium, tmp_path, "--dump-dom", url=f"{page.as_uri()}#step=5&q=pwned&min=0.2&max=0.3")
    assert re.search(r'<span id="count">1 of \d+ samples</span>', dom)
    assert "<mark>PWNED</mark>" in dom
    assert len(re.findall(r'<li [^>]*class="[^"]*nomatch', dom)) == 5  # no other step has it
    dom = _headless(chromium, tmp_path, "--dump-dom", url=f"{page.as_uri()}#step=5&min=2")
    assert "no sample of this step matches" in dom
    print(f"chromium: four page loads in {time.monotonic() - started:.1f} s")

    shot = tmp_path / "view.png"
    _headless(chromium, tmp_path, f"--screenshot={shot}", "--window-size=1280,900", url=f"{page.as_uri()}#step=5")
    assert shot.stat().st_size > 10_000
    if os.environ.get("HEADRACE_VIEW_SCREENSHOT"):  # keep it to look at
        shutil.copy(shot, os.environ["HEADRACE_VIEW_SCREENSHOT"])


def test_view_of_a_run_whose_metrics_hold_nan_writes_the_page_with_them_missing(tmp_path):
    """Issue 22, item 10: a NaN (or an infinity) in metrics.jsonl or a sample, as an older version or
    a hand could leave it, is shown as missing; `headrace view` writes the page and exits 0."""
    import sys

    from helpers import run_argv

    run_dir = tmp_path / "run"
    argv = run_argv(steps=2, run_dir=run_dir, set={"advantages.filter_constant": "false", "log_rollouts": 2})
    done = subprocess.run([sys.executable, "-m", "headrace", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = lines(run_dir / "metrics.jsonl")
    rows[0]["reward/mean"], rows[1]["time/step"] = float("nan"), float("inf")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = lines(run_dir / "rollouts" / "step_000001.jsonl")
    samples[0]["reward"] = float("nan")
    (run_dir / "rollouts" / "step_000001.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    viewed = subprocess.run([sys.executable, "-m", "headrace", "view", str(run_dir)], capture_output=True, text=True)
    assert viewed.returncode == 0, viewed.stderr
    page = (run_dir / "view.html").read_text()
    embedded = re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S)[1]
    data = json.loads(embedded, parse_constant=lambda name: pytest.fail(f"{name} in the page's data"))
    first, second = data["steps"]
    assert first["figures"]["reward/mean"] is None and second["figures"]["time/step"] is None
    assert second["figures"]["reward/mean"] == rows[1]["reward/mean"]
    assert second["samples"][0]["reward"] is None and second["samples"][1]["reward"] is not None
