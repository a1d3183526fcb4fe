"""The docs' examples work as written (README.md and docs/*.md): every Python block runs in a test
(PYTHON_BLOCKS names which), every TOML block is a valid config, and every command of their bash
blocks runs (the cheap ones here, the rest in the slow suite; CANNOT_RUN says which do not, and
why). skills/ is checked the same way by tests/test_skills.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import run_sim

from headrace.plugins import registry
from headrace.run.config import build_config

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def fences(languages: tuple[str, ...], docs: list[Path] = DOCS) -> list[tuple[str, str]]:
    """(where, code) of each fenced block in one of ``languages``, where = 'FILE:LINE'."""
    from markdown_it import MarkdownIt

    out = []
    for doc in docs:
        for token in MarkdownIt().parse(doc.read_text()):
            if token.type == "fence" and token.info.strip() in languages and token.map:
                out.append((f"{doc.relative_to(ROOT)}:{token.map[0] + 1}", token.content))
    return out


def python_block(marker: str, docs: list[Path] = DOCS) -> str:
    """The Python block of the docs that holds ``marker`` (README.md's first where several do)."""
    return next(code for _, code in fences(("python",), docs) if marker in code)


# Each Python block of the docs, by a string only it holds, and the test that runs it as written.
PYTHON_BLOCKS = {
    'register_env("reverse")': "tests/test_readme.py::test_readme_env_example_registers_and_runs",
    "run_with_progress": "tests/test_readme.py::test_readme_from_python_example_runs_with_the_cli_display",
    "agent_env(ctx, solve": "tests/test_readme.py::test_readme_agent_example_runs_its_loop_and_its_tools",
    "/v1/feedback": "tests/test_serve.py::test_the_readme_quick_start_client_runs_as_written",
    "EmulatorThread(Knobs(": "tests/test_readme.py::test_the_emulator_block_runs",
    "class SumTaskset": "tests/test_readme.py::test_the_verifiers_taskset_block_loads_its_tasks",
    # imports `my_env`, the reader's own OpenEnv package: compiled (below), and openenv_dataset's
    # client=/to_action=/to_text= are what tests/test_ecosystem_openenv.py passes
    "from my_env.client import MyEnv": "tests/test_ecosystem_openenv.py",
}


def test_every_python_block_of_the_docs_compiles_and_is_run_by_a_test():
    for where, code in fences(("python",)):
        claimed = [marker for marker in PYTHON_BLOCKS if marker in code]
        assert claimed, f"{where}: a Python block no test runs; add it to PYTHON_BLOCKS with the test that runs it"
        compile(code, where, "exec")
        test_file = PYTHON_BLOCKS[claimed[0]].split("::")[0]
        assert (ROOT / test_file).is_file(), (where, test_file)


def test_the_readme_env_is_the_writing_envs_page_env():
    """README.md shows the env that docs/envs.md explains: one example, word for word."""
    readme = python_block('register_env("reverse")', [ROOT / "README.md"])
    assert readme == python_block('register_env("reverse")', [ROOT / "docs" / "envs.md"])


async def test_readme_env_example_registers_and_runs(tmp_path):
    code = python_block("register_env")
    with registry.envs.scoped("reverse"):  # registered for this test only
        exec(compile(code, "README.md", "exec"), {})
        # the sim never reverses a word: without the filter its constant groups still train
        summary = await run_sim(tmp_path, env="reverse", steps=2, set={"advantages.filter_constant": "false"})
    assert len(summary.metrics) == 2


async def test_readme_env_example_is_written_in_messages_for_any_model():
    """No token ids in it: the same env asks a chat model in the model's own template."""
    from headrace.envs.context import EnvContext
    from tests.env_helpers import action
    from tests.test_renderers import chatml_tokenizer

    code = python_block("register_env")
    assert "encode(" not in code and "tokenizer" not in code
    with registry.envs.scoped("reverse"):
        exec(compile(code, "README.md", "exec"), {})
        ctx = EnvContext(chatml_tokenizer(), 2, 1, 1, 0, max_tokens=8, renderer_name="chat_template")
        env = (await registry.envs.get("reverse")(ctx).get_batch(0)[0].make_envs())[0]
    prompt, _ = await env.initial_observation()
    assert prompt == ctx.renderer.build_generation_prompt(
        [
            {
                "role": "user",
                "content": f"write the letters of {env.word} in reverse order. answer with the letters only.",
            }
        ]
    )
    result = await env.step(action(ctx.renderer, env.word[::-1]))
    assert result.reward == 1.0 and result.metrics["exact"] == 1.0


def test_readme_from_python_example_runs_with_the_cli_display(tmp_path, monkeypatch, capsys):
    """The "From Python" block (docs/quickstart.md), after the env block, as a script would run
    them: only the config is made quick (the sim backend, 2 small steps) and the run directory
    defaulted inside tmp_path."""
    import headrace

    env_code = python_block("register_env")
    script = python_block("run_with_progress")
    real = headrace.build_config
    quick = {"backend": "sim", "steps": 2, "batch_size": 2, "group_size": 2, "progress": True}
    filter_off = ["advantages.filter_constant=false"]  # the sim's constant groups still train
    monkeypatch.setattr(headrace, "build_config", lambda flags: real(flags={**flags, **quick}, overrides=filter_off))
    monkeypatch.chdir(tmp_path)
    with registry.envs.scoped("reverse"):
        namespace: dict = {}
        exec(compile(env_code, "README.md", "exec"), namespace)
        exec(compile(script, "docs/quickstart.md", "exec"), namespace)
    out = capsys.readouterr().out
    run_dir = namespace["summary"].run_dir
    assert run_dir.startswith("runs/reverse-sync-sim-") and (tmp_path / run_dir / "metrics.jsonl").is_file()
    # what `headrace run` shows: the run dir first, then the summary table and the totals line
    assert out.index(f"headrace: run dir {run_dir}") < out.index("run finished") < out.index("2 steps in")
    assert re.search(rf"{re.escape(run_dir)} -?\d+\.\d+$", out.rstrip())  # the block's own print


@pytest.mark.slow
@pytest.mark.timeout(900)  # 5.7 min measured on a CPU shared with three other jobs
async def test_readme_env_example_learns_on_the_default_model(tmp_path):
    """What the README says of its example: on the embedded model, 40 steps raise the reward."""
    code = python_block("register_env")
    with registry.envs.scoped("reverse"):
        exec(compile(code, "README.md", "exec"), {})
        summary = await run_sim(tmp_path, env="reverse", backend="torch", steps=40, batch_size=32, group_size=16)
    rewards = [row["reward/mean"] for row in summary.metrics]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.25, rewards  # measured: 0.02 -> 0.37


async def test_readme_agent_example_runs_its_loop_and_its_tools():
    """The "Bring your agent" block (docs/agents.md), its episode driven by a scripted sampler: a
    call, its result, the answer."""
    pytest.importorskip("openai")
    from headrace.agents.env import AgentEnv
    from headrace.core.episode import run_episode
    from tests.test_agents import SPEC, Script, endpoint

    code = python_block("agent_env(ctx, solve")
    scope: dict = {}
    exec(compile(code, "docs/agents.md", "exec"), scope)
    script = Script("<call>add(a=2,b=3)</call>", "5")
    trajectory = await run_episode(AgentEnv(scope["solve"], (2, 3), endpoint()), script, SPEC, seed=0)
    assert trajectory.total_reward == 1.0 and len(trajectory.transitions) == 2
    assert trajectory.transitions[-1].metrics["agent/tool_calls"] == 1.0


@pytest.mark.timeout(120)  # the torch-backed emulator: imports torch, builds the tiny model
def test_the_emulator_block_runs():
    """docs/tinker.md's in-process emulator, as written: it starts, serves and says what it holds."""
    code = python_block("EmulatorThread(Knobs(")
    scope: dict = {}
    exec(compile(code, "docs/tinker.md", "exec"), scope)
    assert scope["emu"].url.startswith("http://127.0.0.1:")  # the block itself read its log and models


@pytest.mark.timeout(120)  # importing verifiers takes 5-30 s on a loaded machine
def test_the_verifiers_taskset_block_loads_its_tasks():
    """docs/ecosystem.md's own verifiers environment: its taskset loads the 100 sums."""
    pytest.importorskip("verifiers")
    import verifiers.v1 as vf

    scope: dict = {}
    exec(compile(python_block("class SumTaskset"), "docs/ecosystem.md", "exec"), scope)
    tasks = scope["SumTaskset"](vf.TasksetConfig()).load()
    assert len(tasks) == 100 and tasks[23].data.answer == "5"


def test_each_toml_block_of_the_docs_is_valid(tmp_path):
    """A run's TOML file (the quick start's, the reference's, a section's) is a config build_config
    takes; a package's entry points parse as TOML."""
    import tomllib

    for where, code in fences(("toml",)):
        tree = tomllib.loads(code)
        if "project" in tree:
            assert "entry-points" in tree["project"], where
            continue
        path = tmp_path / "run.toml"
        path.write_text(code)
        build_config(path)


# ---- every command the docs show, run as written (issue 22, item 9) ----
#
# The commands are read from the docs' bash blocks (README.md, and docs/*.md where they exist) with a
# Markdown parser, one a line (a trailing `# comment` dropped, `\` continuations joined), and run
# in order, block by block, in a fresh directory with this Python's `headrace` first on the PATH.
# A command the docs add runs too; the lists below say which ones a test cannot run (and why) and
# which run only in the slow suite. Each entry is the start of a command as written.

CANNOT_RUN = {
    # the hybrid topology's block names the reader's model directory (DIR): tests/test_serve_hybrid.py runs it
    "headrace tinker-emulator --model DIR": "DIR is the reader's model directory (test_serve_hybrid.py)",
    "headrace serve --backend tinker --sampler vllm": "the hybrid serve on DIR (test_serve_hybrid.py)",
    "headrace run --backend tinker --sampler vllm": "the hybrid run on DIR (test_serve_hybrid.py)",
    # docs/post-training.md: each reads a data file or a run directory the reader makes; the same
    # commands run on generated data in tests/test_posttrain_sft.py, _distill.py and _tinker.py
    "headrace sft --data sums.jsonl": "sums.jsonl is the reader's data (test_posttrain_sft.py runs sft)",
    "headrace sft --run-dir runs/sft --resume": "resumes the run above (test_posttrain_sft.py resumes one)",
    "headrace sft --backend tinker": "an emulator on 8765 and the reader's data (test_posttrain_tinker.py)",
    "headrace dpo --data pairs.jsonl": "pairs.jsonl is the reader's data (test_posttrain_tinker.py, _sft.py run dpo)",
    "headrace run --env arithmetic --teacher runs/teacher": "runs/teacher is the reader's run (test_posttrain_distill.py)",
    "headrace run --env arithmetic --teacher smollm2-135m": "two SmolLM2 backends on a CPU (test_posttrain_distill.py: tiny)",
    "headrace sdft --data demos.jsonl": "demos.jsonl is the reader's data (test_posttrain_tinker.py runs sdft)",
    "make test": "runs this suite",
    "make run": "sets up .venv with pip first; the run it starts is `headrace run` (RUNS_AS, slow)",
    "source .venv/bin/activate": "changes the reader's shell, which a test does not have",
    "pip install": "installs packages into the environment",
    "python -m headrace run ...": "the '...' stands for the options of any command above",
    "headrace run --config my_run.toml": "my_run.toml is a file the reader writes",
    "export TINKER_API_KEY=": "a key to the hosted Tinker service",
    "headrace run --backend tinker --model Qwen/": "the hosted Tinker service",
    "headrace tinker-emulator --port 8765 --model smollm2-135m": "the run after it is 120 SmolLM2 steps at 256 tokens",
    "headrace run --backend tinker --tinker-url http://127.0.0.1:8765 --model smollm2-135m": "120 SmolLM2 steps",
    "export HEADRACE_API_TOKEN=": "the serve block: test_serve.py runs it with the README's client",
    "headrace serve": "a server that runs until it is stopped: test_serve.py runs the README's client against it",
    "headrace run --cluster ray --set ray.address=ray://": "an existing Ray cluster",
    "headrace run --env openenv --set env_options.url=": (
        "an OpenEnv server the reader started (test_ecosystem_openenv.py starts one)"
    ),
    "headrace run --env verifiers --set env_options.id=reverse-text --model smollm2-135m": (
        "120 SmolLM2 steps of an installed verifiers environment (test_ecosystem_verifiers.py runs them short)"
    ),
    "headrace run --cluster ray --backend torch": "the default run on Ray: 120 steps through Ray actors",
    # docs/serve-round2.md: requests to the server its block starts (test_serve*.py send them with the clients)
    "curl -s localhost:8000/": "a request to the `headrace serve` above, which a test does not start",
    "tail -1 runs/serve/versions.jsonl": "the chain of the `headrace serve` above",
    "headrace run --backend torch --model tiny --env arithmetic --steps 60 --save-every 10": (
        "the gate benchmark's training run (75 s); test_serve_gate.py checks the gate's test itself"
    ),
    "python benchmarks/serve_gate.py": "200 gate trials (about 10 minutes); its figures are in RESULTS.md",
}
SLOW = {
    "headrace run --backend torch --model smollm2-135m": "SmolLM2 on a CPU: about a minute a step",
    "headrace view runs/smol": "the page of the SmolLM2 run before it",
    "headrace tinker-emulator --port 8765 --clock-cycle-s 0.5": "the default run through the emulator, after it",
    "headrace run --backend tinker --tinker-url http://127.0.0.1:8765 --scheduler async": "the default run on Tinker",
}
# A command that the docs give only inside another (`make run` is setup, then this).
RUNS_AS = {"make run": "headrace run --run-dir runs/default"}


def _start(command: str, entries: dict[str, str]) -> str | None:
    return next((start for start in entries if command.startswith(start)), None)


def doc_commands(docs: list[Path] = DOCS) -> list[tuple[str, list[str]]]:
    """(where, commands) for each bash block of the docs, where = 'FILE:LINE'."""
    blocks = []
    for where, code in fences(("bash", "sh", "shell"), docs):
        lines = code.replace("\\\n", " ").splitlines()
        blocks.append((where, [" ".join(words) for line in lines if (words := shlex.split(line, comments=True))]))
    return blocks


def _is_slow(commands: list[str]) -> bool:
    return any(_start(c, SLOW) or _start(c, RUNS_AS) for c in commands)


def _blocks(slow: bool) -> list:
    """The blocks to run: a block that repeats an earlier one word for word (the README's two
    commands, again at the top of the quick start) runs once."""
    seen: set[tuple[str, ...]] = set()
    params = []
    for where, commands in doc_commands():
        if tuple(commands) in seen:
            continue
        seen.add(tuple(commands))
        runs = [RUNS_AS.get(_start(c, RUNS_AS) or "", c) for c in commands]
        runs = [c for c in runs if not _start(c, CANNOT_RUN)]
        if _is_slow(commands) == slow and runs:
            # a block that starts vLLM or Ray runs with the other vLLM and Ray tests (conftest: serial)
            marks = [pytest.mark.vllm] * any("vllm" in c for c in runs)
            marks += [pytest.mark.ray] * any("--cluster ray" in c for c in runs)
            params.append(pytest.param(commands, id=where, marks=marks))
    return params


def _on_free_ports(commands: list[str]) -> list[str]:
    """The block with each port it names (`--port 8765`, `http://127.0.0.1:8765`) moved to a free
    one: two blocks, or a server of the reader's, never meet on a port."""
    ports = {match for c in commands for match in re.findall(r"--port (\d+)", c)}
    for port in ports:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = str(probe.getsockname()[1])
        commands = [re.sub(rf"(?<=--port ){port}\b|(?<=:){port}\b", free, c) for c in commands]
    return commands


def _run_block(commands: list[str], cwd: Path, timeout: float, check: Callable[[str, str], None]) -> None:
    """Each command of the block, in order, in ``cwd``; ``check(command, stdout)`` after each. A
    command ending in `&` is a server: started, waited for on its --port, stopped after the block."""
    env = os.environ | {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "TINKER_TELEMETRY": "0",
    }
    servers: list[subprocess.Popen] = []
    runs = [RUNS_AS.get(_start(command, RUNS_AS) or "", command) for command in commands]
    try:
        for command in _on_free_ports([c for c in runs if not _start(c, CANNOT_RUN)]):
            if command.endswith("&"):
                server = subprocess.Popen(
                    command.removesuffix("&"), shell=True, cwd=cwd, env=env, start_new_session=True
                )
                servers.append(server)
                _wait_for_port(int(re.search(r"--port (\d+)", command)[1]), server)
                continue
            done = subprocess.run(
                command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
            )
            assert done.returncode == 0, f"`{command}` exited {done.returncode}:\n{done.stderr[-3000:]}"
            check(command, done.stdout)
    finally:
        for server in servers:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)


def _wait_for_port(port: int, server: subprocess.Popen, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server on port {port} exited ({server.returncode})"
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on port {port} after {limit_s} s")


def _metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_every_listed_command_is_in_the_docs():
    """An entry the docs no longer hold is stale: remove it (a moved command keeps its entry)."""
    written = [c for _, commands in doc_commands() for c in commands]
    for start in [*CANNOT_RUN, *SLOW, *RUNS_AS]:
        assert any(c.startswith(start) for c in written), f"no command in the docs starts with {start!r}"


def _steps_as_asked(cwd: Path, command: str) -> None:
    """A `headrace run --steps N --run-dir D` leaves N rows in D (a resume: N in all)."""
    run_dir, steps = re.search(r"--run-dir (\S+)", command), re.search(r"--steps (\d+)", command)
    refused = "|| [ $? -eq 2 ]" in command  # shown failing before it starts: it writes no rows
    if command.startswith("headrace run") and run_dir and steps and not refused:
        assert len(_metric_rows(cwd / run_dir[1])) == int(steps[1]), command


@pytest.mark.timeout(300)
@pytest.mark.parametrize("commands", _blocks(slow=False))
def test_each_command_the_docs_show_runs_as_written(commands, tmp_path):
    def check(command: str, out: str) -> None:
        _steps_as_asked(tmp_path, command)
        if command == "headrace --version":
            assert out.startswith("headrace ")

    _run_block(commands, tmp_path, timeout=240, check=check)


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("commands", _blocks(slow=True))
def test_each_slow_command_the_docs_show_runs_as_written(commands, tmp_path):
    """The SmolLM2 run trains (it ended in 'no update was applied'), the view page is written, the
    default run learns as the README's table says, the emulator serves the default run."""

    def check(command: str, out: str) -> None:
        _steps_as_asked(tmp_path, command)
        if command.startswith("headrace view"):
            assert re.search(r"wrote \S+view.html \(\d+ steps, \d+ samples", out), out
        if command == RUNS_AS["make run"]:  # the README's table: seed 0 ends near 0.9 (mean of the last 12 steps)
            rows = _metric_rows(tmp_path / "runs" / "default")
            last = sum(r["reward/mean"] for r in rows[-12:]) / 12
            assert len(rows) == build_config().steps and last >= 0.75, last

    _run_block(commands, tmp_path, timeout=2000, check=check)
