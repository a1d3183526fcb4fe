"""A second Ctrl-C or SIGTERM exits at once whatever the event loop is doing (issue 22, item 6):
an env that blocks the loop with time.sleep, a batch so large the loop is busy for many seconds,
and `headrace serve` with a gate env that blocks it. The directory is then resumable as after
kill -9, and the env call that held the loop is named in a warning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import run_argv

from tests.serve_support import serving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

BLOCKING_ENV = """
import os, random, time

from headrace import EnvContext, GroupOf, ProblemDataset
from headrace.envs.message import ProblemEnv


class Blocking(ProblemEnv):
    def question(self) -> str:
        return "what is 1+1?"

    async def check_answer(self, text: str) -> bool:
        if "BLOCK_MARKER" in os.environ:
            open(os.environ["BLOCK_MARKER"], "w").close()
        time.sleep(float(os.environ.get("BLOCK_S", "30")))  # the user's bug: it blocks the event loop
        return True


def make_dataset(ctx: EnvContext) -> ProblemDataset:
    def group(rng: random.Random) -> GroupOf:
        return GroupOf.of(Blocking, ctx.group_size, renderer=ctx.renderer, max_tokens=ctx.max_tokens)

    return ProblemDataset.from_context(ctx, group)
"""


class Watched:
    """A `headrace` subprocess whose stderr is read as it comes."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "headrace", *argv],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
        )  # fmt: skip
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout_s: float) -> str | None:
        """The first line holding ``text``, or None if none came within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = next((line for line in self.lines if text in line), None)
            if found is not None:
                return found
            assert self.proc.poll() is None, f"exited {self.proc.returncode}: {''.join(self.lines)}"
            time.sleep(0.1)
        return None

    def signal_twice(self, sig: signal.Signals) -> float:
        """Two signals a second apart; how long the process lived after the second."""
        self.proc.send_signal(sig)
        time.sleep(1)
        self.proc.send_signal(sig)
        second = time.monotonic()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"still running 15 s after the second {sig.name}: {''.join(self.lines)}") from None
        return time.monotonic() - second


def wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"no {path} (exit status {proc.poll()})"
        time.sleep(0.1)


def test_a_second_ctrl_c_exits_while_an_env_blocks_the_loop_and_the_run_resumes(tmp_path):
    env_file, marker = tmp_path / "blocking_env.py", tmp_path / "blocking"
    env_file.write_text(BLOCKING_ENV)
    run_dir = tmp_path / "run"
    argv = run_argv(
        env=f"{env_file}:make_dataset", steps=2, run_dir=run_dir, set={"advantages.filter_constant": "false"}
    )
    run = Watched(argv, env={"BLOCK_MARKER": str(marker)})
    wait_for_file(marker, run.proc)  # check_answer is in time.sleep(30): the loop is blocked
    warning = run.wait_for("has held the event loop", timeout_s=15)
    lived = run.signal_twice(signal.SIGINT)
    assert run.proc.returncode == 130 and lived < 5, (lived, run.lines)
    assert any("second SIGINT, exiting now" in line for line in run.lines)
    # the warning named the env, its call and the engine's line that made it
    assert warning is not None, run.lines
    assert f"check_answer ({env_file}:" in warning and "await env.step(action)" in warning, warning
    assert f"in env '{env_file}:make_dataset'" in warning and "asyncio.to_thread" in warning, warning
    resumed = subprocess.run(
        [sys.executable, "-m", "headrace", *argv, "--resume"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "BLOCK_S": "0"},
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]


def test_a_second_sigterm_exits_while_a_huge_batch_keeps_the_loop_busy(tmp_path):
    run_dir = tmp_path / "run"
    run = Watched(run_argv(batch_size=100_000, group_size=4, steps=2, run_dir=run_dir))
    wait_for_file(run_dir / "log.jsonl", run.proc)
    deadline = time.monotonic() + 60
    while "run_start" not in (run_dir / "log.jsonl").read_text():
        assert time.monotonic() < deadline and run.proc.poll() is None, run.lines
        time.sleep(0.1)
    time.sleep(3)  # admitting 100,000 groups keeps the loop busy for many seconds more
    lived = run.signal_twice(signal.SIGTERM)
    assert run.proc.returncode == 143 and lived < 5, (lived, run.lines)
    assert any("second SIGTERM, exiting now" in line for line in run.lines)
    assert not any("wakeup fd" in line for line in run.lines), run.lines


def test_a_second_sigterm_ends_serve_while_its_gate_env_blocks_the_loop(tmp_path, monkeypatch):
    env_file, marker = tmp_path / "blocking_env.py", tmp_path / "blocking"
    env_file.write_text(BLOCKING_ENV)
    monkeypatch.setenv("BLOCK_MARKER", str(marker))
    gate = ["serve.gate=env", f"serve.gate_env={env_file}:make_dataset", "serve.gate_min_reward=0",
            "serve.gate_env_options={}", "serve.gate_problems=1"]  # fmt: skip
    with serving(tmp_path / "d", "--batch-size", "2", *[a for g in gate for a in ("--set", g)]) as server:
        ids = [server.chat(f"hello {i}")[0].id for i in range(2)]
        assert server.post("/v1/feedback", [{"id": ids[0], "reward": 0.0}, {"id": ids[1], "reward": 1.0}]).is_success
        wait_for_file(marker, server.proc)  # the gate's check_answer is in time.sleep(30)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(1)
        server.proc.send_signal(signal.SIGTERM)
        second = time.monotonic()
        try:
            server.proc.wait(15)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still serving 15 s after the second SIGTERM: {''.join(server.output)}") from None
        assert server.proc.returncode == 143 and time.monotonic() - second < 5
    monkeypatch.delenv("BLOCK_MARKER")
    with serving(tmp_path / "d", "--resume") as server:  # what was published is still served
        assert server.version_at_start == 0


def test_the_signal_handlers_are_put_back_after_a_run(tmp_path):
    """`train(handle_signals=True)` in a script: Ctrl-C afterwards is the script's again."""
    script = tmp_path / "script.py"
    script.write_text(
        "import signal, anyio\n"
        "from headrace.run.config import build_config\n"
        "from headrace.run.train import train\n"
        f"config = build_config(flags={{'backend': 'sim', 'steps': 1, 'run_dir': {str(tmp_path / 'run')!r}}},\n"
        "                      overrides=['advantages.filter_constant=false'])\n"
        "before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), signal.set_wakeup_fd(-1)\n"
        "anyio.run(lambda: train(config, handle_signals=True))\n"
        "after = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), signal.set_wakeup_fd(-1)\n"
        "assert before == after, (before, after)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=Path.cwd())
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
