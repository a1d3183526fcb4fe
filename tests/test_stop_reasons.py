"""Why each completion ended (a stop token, ``max_tokens``, the model's context), as the rollout
samples and the ``headrace view`` page say it, on every backend (issue 22, item 12: every sample
said ``done``, the episode's end, while 98% of them were cut off at ``max_tokens``). The tinker
and vllm backends are checked in their own CLI tests (``test_tinker_run.py``, ``test_vllm_cli.py``)
with :func:`assert_stop_reasons_are_told`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_argv

pytestmark = pytest.mark.timeout(120)


def samples(run_dir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted((run_dir / "rollouts").glob("*.jsonl")) for line in path.open()]


def assert_stop_reasons_are_told(run_dir: Path, max_tokens: int) -> list[str]:
    """Each sample's reason agrees with its length: one cut off has ``max_tokens`` tokens, one that
    stopped at a stop token may be shorter; the episode's own end is apart (``episode_end``)."""
    records = samples(run_dir)
    assert records
    for r in records:
        assert r["episode_end"] == "done", r
        assert r["stop_reason"] in ("stop", "length"), r
        if r["stop_reason"] == "length":
            assert r["completion_tokens"] == max_tokens, r
        assert r["completion_tokens"] <= max_tokens, r
    return [r["stop_reason"] for r in records]


def headrace(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "headrace", *args], capture_output=True, text=True, timeout=100)


def test_sim_samples_say_whether_they_stopped_or_were_cut_off_and_the_page_shows_it(tmp_path):
    run_dir = tmp_path / "run"
    # 3 tokens: the sim's version stamp, then one digit and its end token, or two digits cut off
    out = headrace(*run_argv(run_dir=run_dir, max_tokens=3, set={"advantages.filter_constant": "false"}))
    assert out.returncode == 0, out.stderr
    reasons = assert_stop_reasons_are_told(run_dir, max_tokens=3)
    assert set(reasons) == {"stop", "length"}, reasons
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert 0 < rows[0]["env/all/truncated"] < 1  # the env's own count agrees: some were cut off
    assert headrace("view", str(run_dir)).returncode == 0
    page = (run_dir / "view.html").read_text()
    assert '"stop_reason": "length"' in page or '"stop_reason":"length"' in page


def test_a_sample_cut_short_by_the_models_context_says_so(tmp_path):
    run_dir = tmp_path / "run"
    # prompts of 4 tokens (a+b=) in a context of 6: room for 2 of the 8 tokens asked for
    argv = run_argv(run_dir=run_dir, max_tokens=8, set={"sim.max_context": 6, "advantages.filter_constant": "false"})
    out = headrace(*argv)
    assert out.returncode == 0, out.stderr
    records = samples(run_dir)
    assert records and {r["stop_reason"] for r in records} == {"context_overflow"}
    assert all(r["completion_tokens"] == 2 for r in records)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_samples_of_the_tiny_model_say_why_they_ended(tmp_path):
    """The default model at step 0 is cut off at its 2 tokens almost every time."""
    run_dir = tmp_path / "run"
    out = headrace(*run_argv(run_dir=run_dir, backend="torch", steps=2, batch_size=8, group_size=8))
    assert out.returncode in (0, 1), out.stderr  # 1: no update, if every group was filtered
    reasons = assert_stop_reasons_are_told(run_dir, max_tokens=2)
    assert "length" in reasons
