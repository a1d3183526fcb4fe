"""Harbor-format tasks without a container: the shipped examples pass with their own solutions
(Harbor's oracle), answers are run and verified in a no-network root, the tests stay hidden
from the agent, stale rewards and timeouts are handled, what cannot run is refused clearly, and
the env runs through `headrace run` on sim (a subprocess) and on the tiny torch model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from headrace.envs.context import EnvContext
from headrace.tasks.harbor import HarborEnv, make_dataset, oracle
from headrace.tasks.harbor_format import HarborTaskError, find_tasks, load_task
from tests.env_helpers import chatml_renderer, drive, run_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "harbor_tasks"


@pytest.fixture(autouse=True)
def _own_tempdir(tmp_path, monkeypatch):
    """Every episode root lands under tmp_path, so a test can see that none is left behind."""
    (tmp_path / "roots").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "roots"))


def _left(tmp_path) -> list[str]:
    return [p.name for p in (tmp_path / "roots").iterdir() if p.name.startswith("headrace-harbor-")]


def _task(tmp_path, name="t", test_sh="echo 1 > /logs/verifier/reward.txt", toml="", dockerfile=None):
    task = tmp_path / name
    (task / "tests").mkdir(parents=True)
    (task / "task.toml").write_text(f'schema_version = "1.4"\n{toml}\n[environment]\nworkdir = "/app"\n')
    (task / "instruction.md").write_text("Do the thing.")
    (task / "tests" / "test.sh").write_text(f"#!/bin/bash\n{test_sh}\n")
    if dockerfile is not None:
        (task / "environment").mkdir()
        (task / "environment" / "Dockerfile").write_text(dockerfile)
    return task


def _bash(script: str) -> str:
    return f"Here:\n```bash\n{script}\n```"


async def test_every_shipped_example_passes_with_its_own_solution(tmp_path):
    tasks = find_tasks(EXAMPLES)
    assert len(tasks) == 4
    for task in tasks:
        reward, metrics, _ = await oracle(task)
        assert reward == 1.0, task.name
        assert metrics["no_reward"] == 0.0
    assert _left(tmp_path) == []


async def test_a_shell_answer_is_run_then_verified_and_wrong_answers_score_what_the_tests_say(tmp_path):
    r = chatml_renderer()
    hello = load_task(EXAMPLES / "hello-world")
    for script, want in [("echo 'Hello, world!' > /app/hello.txt", 1.0), ("echo hi > /app/hello.txt", 0.0)]:
        env = HarborEnv(hello, r, 64)
        observations, _, results = await drive(env, r, [_bash(script)])
        assert "hello.txt" in r.hf.decode(observations[0]) and "```bash" in r.hf.decode(observations[0])
        assert results[-1].done and results[-1].reward == want
        assert results[-1].metrics["correct"] == want and results[-1].metrics["agent_s"] > 0
    fizz = load_task(EXAMPLES / "fizzbuzz")
    env = HarborEnv(fizz, r, 64)
    _, _, results = await drive(env, r, [_bash("printf 'print(1)\\nprint(2)\\nprint(3)' > /app/fizzbuzz.py")])
    assert results[-1].reward == pytest.approx(2 / 20)  # partial credit from reward.txt
    assert _left(tmp_path) == []


async def test_an_answer_file_task_writes_the_reply_and_reward_json_is_read():
    r = chatml_renderer()
    env = HarborEnv(load_task(EXAMPLES / "palindrome"), r, 64)
    answer = "```python\ndef is_palindrome(s):\n    return s == s[::-1]\n```"  # case and spaces not ignored
    _, _, results = await drive(env, r, [answer])
    assert results[-1].reward == pytest.approx(4 / 6)
    env = HarborEnv(load_task(EXAMPLES / "csv-total"), r, 64)
    _, _, results = await drive(env, r, [_bash("echo 100 > /app/out/total.txt")])
    assert results[-1].reward == 1.0 and results[-1].metrics["reward/exact"] == 1.0


async def test_multi_turn_shows_command_output_and_the_tests_only_after_the_agent():
    r = chatml_renderer()
    env = HarborEnv(load_task(EXAMPLES / "csv-total"), r, 64, turns=4)
    replies = [
        _bash("ls /app/data; cat /app/out/.setup; ls /tests"),
        _bash("python3 -c \"import csv; print(sum(int(r['amount']) for r in csv.DictReader(open('data/sales.csv'))))\""
              " > out/total.txt"),
        "Done.",
    ]  # fmt: skip
    observations, actions, results = await drive(env, r, replies)
    shown = r.hf.decode(observations[1][len(observations[0]) + len(actions[0].tokens) :])
    assert "sales.csv" in shown and "prepared" in shown  # the Dockerfile's COPY and RUN
    assert "exit code 2" in shown and "No such file" in shown  # /tests is not there yet
    assert len(results) == 3 and results[-1].reward == 1.0 and results[-1].metrics["commands"] == 2.0


async def test_network_is_off_and_a_stale_reward_from_the_agent_is_discarded(tmp_path):
    r = chatml_renderer()
    online = "(exec 3<>/dev/tcp/1.1.1.1/53) 2>/dev/null"
    probe = f"{online} && echo 1 > /logs/verifier/reward.txt || echo 0.5 > /logs/verifier/reward.txt"
    env = HarborEnv(load_task(_task(tmp_path, "net", probe)), r, 64)
    _, _, results = await drive(env, r, [_bash("(exec 3<>/dev/tcp/1.1.1.1/53) && touch /app/online")])
    assert results[-1].reward == 0.5 and results[-1].metrics["agent_failed"] == 1.0
    env = HarborEnv(load_task(_task(tmp_path, "stale", "true")), r, 64)
    stale = "mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; mkdir -p locked/in; chmod 0 locked"
    _, _, results = await drive(env, r, [_bash(stale)])
    assert results[-1].reward == 0.0 and results[-1].metrics["no_reward"] == 1.0
    assert _left(tmp_path) == []  # even the directory the agent locked is gone


async def test_an_agent_that_hangs_is_stopped_and_still_verified(tmp_path):
    r = chatml_renderer()
    env = HarborEnv(load_task(_task(tmp_path)), r, 64, max_timeout_s=1.0)
    _, _, results = await drive(env, r, [_bash("sleep 60")])
    m = results[-1].metrics
    assert m["agent_timeout"] == 1.0 and results[-1].reward == 1.0 and m["agent_s"] < 10
    assert _left(tmp_path) == []


async def test_what_cannot_run_without_a_container_is_refused_with_the_reason(tmp_path):
    with pytest.raises(HarborTaskError, match="no tests/test.sh"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "task.toml").write_text("")
        (tmp_path / "empty" / "instruction.md").write_text("x")
        load_task(tmp_path / "empty")
    with pytest.raises(HarborTaskError, match="multi-step"):
        load_task(_task(tmp_path, "steps", toml='[[steps]]\nname = "one"'))
    with pytest.raises(HarborTaskError, match="copies from another image"):
        load_task(_task(tmp_path, "from", dockerfile="FROM x\nCOPY --from=build /a /b\n"))
    compose = _task(tmp_path, "compose", dockerfile="FROM x\n")
    (compose / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    with pytest.raises(HarborTaskError, match="docker-compose"):
        load_task(compose)
    fetch = "RUN python3 -c \"import urllib.request; urllib.request.urlopen('http://example.com')\"\n"
    installs = _task(tmp_path, "fetch", dockerfile=f"FROM ubuntu\n{fetch}")
    env = HarborEnv(load_task(installs), chatml_renderer(), 64, max_timeout_s=20)
    with pytest.raises(HarborTaskError, match="(?s)RUN steps failed here.*URLError.*network off"):
        await env.initial_observation()
    assert _left(tmp_path) == []


def _ctx(**options) -> EnvContext:
    from headrace.tokenizers.hf import HFTokenizer

    r = chatml_renderer()
    return EnvContext(tokenizer=HFTokenizer(r.hf), group_size=2, batch_size=2, steps=3, seed=0, max_tokens=64,
                      options=options, model="./chat", renderer_name=r.name)  # fmt: skip


def test_splits_options_and_pickling():
    import pickle

    train = make_dataset(_ctx(path=str(EXAMPLES)))
    names = {b.task.name for i in range(len(train)) for b in train.get_batch(i)}
    assert names == {"headrace/hello-world", "headrace/fizzbuzz", "headrace/csv-total"}
    test = make_dataset(_ctx(path=str(EXAMPLES), split="test"))
    assert [b.task.name for b in test.get_batch(0)] == ["headrace/palindrome"]
    builder = pickle.loads(pickle.dumps(train.get_batch(0)[0]))
    assert builder.task == train.get_batch(0)[0].task and builder.envs == []
    with pytest.raises(ValueError, match="needs env_options.path"):
        make_dataset(_ctx())
    with pytest.raises(ValueError, match="did you mean 'turns'"):
        make_dataset(_ctx(path=str(EXAMPLES), turn=2))


def test_headrace_run_on_sim_in_a_subprocess(tmp_path):
    tasks = tmp_path / "tasks"
    shutil.copytree(EXAMPLES, tasks)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "headrace", "run", "--backend", "sim", "--env", "harbor", "--steps", "2"]
    cmd += ["--batch-size", "2", "--group-size", "2", "--run-dir", str(run_dir), "--no-progress"]
    cmd += ["--set", f"env_options.path={tasks}", "--set", "advantages.filter_constant=false"]
    cmd += ["--set", "env_options.max_timeout_s=5", "--set", "eval.every=2", "--set", "eval.problems=1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["env/harbor/no_reward"] == 0.0 for row in rows)
    assert all(0.0 <= row["env/harbor/reward"] <= 1.0 and row["env/harbor/verifier_s"] > 0 for row in rows)
    assert rows[-1]["eval/harbor/problems"] == 1


@pytest.mark.slow
async def test_two_steps_on_the_tiny_torch_model(tmp_path):
    pytest.importorskip("torch")
    from headrace.run.train import train

    verdict = "[[ -f /app/a ]] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt"
    task = _task(tmp_path, test_sh=verdict)
    (task / "instruction.md").write_text("make a file a.")  # the tiny model's context is 256 characters
    summary = await train(run_config(tmp_path, "harbor", "torch", {"path": str(task), "max_timeout_s": 5}))
    assert summary.steps == 2 and all("env/harbor/reward" in row for row in summary.metrics)
