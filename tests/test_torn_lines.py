"""A torn last line (what kill -9 leaves mid-write) is cut off before the next record is appended,
so nothing acknowledged after it is lost (issue 22, item 5): each append-only file is torn at
several byte offsets, the real `headrace serve` / `headrace run` appends, is killed with -9 and
resumed, and every completion, reward, published version and checkpoint it acknowledged is there."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import run_argv

from headrace.run.rundir import RunDir
from tests.serve_support import serving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
# where each round tears the next line: after its first byte, in its middle, just before its newline
CUTS = ("first byte", "half", "all but the newline")


def tear(path: Path, cut: str) -> None:
    """Append a prefix of a line like the file's last, without its newline: a write kill -9 cut short."""
    line = path.read_bytes().splitlines()[-1]
    size = {"first byte": 1, "half": len(line) // 2, "all but the newline": len(line)}[cut]
    with open(path, "ab") as f:
        f.write(line[:size])


def parsed(path: Path) -> list[dict]:
    """Every line of the file, each of which must be JSON: no record was glued onto a torn one."""
    return [json.loads(line) for line in path.read_text().splitlines()]


SERVE_FILES = ("completions.jsonl", "feedback.jsonl", "versions.jsonl")


def test_serve_loses_no_completion_reward_or_version_after_a_torn_line(tmp_path):
    """Each round tears all three files at once (one server start a round, not three: CI time)."""
    run_dir = tmp_path / "d"
    rewarded, unrewarded, version = [], [], 0
    with serving(run_dir, "--batch-size", "2") as server:
        ids = [server.chat(f"first {i}")[0].id for i in range(2)]
        assert server.post("/v1/feedback", [{"id": c, "reward": float(i)} for i, c in enumerate(ids)]).is_success
        version = server.wait_for_line(1)["version"]
        rewarded += ids
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(30)
    for round_, cut in enumerate(CUTS):
        for torn in SERVE_FILES:
            tear(run_dir / torn, cut)
        with serving(run_dir, "--resume") as server:
            assert server.version_at_start == version, f"round {round_}: a published version was lost"
            ids = [server.chat(f"round {round_} {i}")[0].id for i in range(3)]
            answer = server.post("/v1/feedback", [{"id": ids[0], "reward": 0.0}, {"id": ids[1], "reward": 1.0}])
            assert answer.status_code == 200, answer.text
            line = server.wait_for_line(2 + round_)
            assert line["outcome"] == "published", line
            assert server.chat("served by the new version")[1] == line["version"]
            version = line["version"]
            rewarded += ids[:2]
            unrewarded.append(ids[2])
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(30)
    with serving(run_dir, "--resume") as server:
        assert server.version_at_start == version
        for cid in rewarded:  # each reward remembered: a second one is refused
            assert server.post("/v1/feedback", {"id": cid, "reward": 1.0}).status_code == 409, cid
        for cid in unrewarded:  # each completion known: its first reward is taken
            assert server.post("/v1/feedback", {"id": cid, "reward": 1.0}).status_code == 200, cid
    for name in SERVE_FILES:
        parsed(run_dir / name)
    assert [e["version"] for e in parsed(run_dir / "versions.jsonl")] == list(range(len(CUTS) + 2))


# slow enough to be killed mid-run
SIM = {"sim.sample_token_s": 0.004, "sim.train_step_s": 0.01, "sim.optim_step_s": 0.01, "checkpoint.keep_last": 2}


def run_cmd(run_dir: Path, steps: int, *extra: str) -> list[str]:
    argv = run_argv(*extra, steps=steps, batch_size=4, save_every=1, run_dir=run_dir, set=SIM)
    return [sys.executable, "-m", "headrace", *argv]


def rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_bytes().splitlines()) if path.exists() else 0


def test_run_loses_no_checkpoint_record_after_a_torn_index_line(tmp_path):
    run_dir = tmp_path / "run"
    index = run_dir / "checkpoints" / "index.jsonl"
    subprocess.run(run_cmd(run_dir, 4), check=True, capture_output=True, timeout=120)
    steps = 4
    for cut in CUTS:
        tear(index, cut)
        steps += 12
        proc = subprocess.Popen(run_cmd(run_dir, steps, "--resume"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while rows(run_dir) < steps - 9:  # a few checkpoints recorded after the torn line
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    done = subprocess.run(run_cmd(run_dir, steps, "--resume"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    entries = parsed(index)  # every line whole: no record was appended onto a torn one
    recorded = {e["step"] for e in entries if not e.get("deleted")}
    assert recorded == set(range(1, steps + 1)), "a checkpoint's record was lost"
    kept = [e["step"] for e in RunDir(run_dir).kept_checkpoints()]
    assert kept == [steps - 1, steps], "pruning lost track of a checkpoint"
