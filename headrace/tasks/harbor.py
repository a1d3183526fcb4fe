"""``harbor``: Harbor task directories as an env (``--env harbor --set env_options.path=DIR``),
run without a container runtime (``harbor_format`` says what of the format is honoured).

Each episode gets a fresh root directory (``rootfs``: seen as ``/`` by every command, the host's
system dirs read-only, no network): the environment's ``COPY`` files and ``RUN`` steps set it
up, the prompt is ``instruction.md`` plus how to answer, the answer runs as the agent, then
``tests/`` is copied to ``/tests`` (after the agent: it never sees them) and ``/tests/test.sh``
runs from the workdir, its output in ``/logs/verifier/test-stdout.txt``. The reward is
``/logs/verifier/reward.json``'s ``reward_key`` (``reward``), else ``reward.txt``, as Harbor's
verifier reads them; no reward file is reward 0 with ``no_reward`` 1.

How the model answers (single turn, ``turns=1``): a bash script, the reply's last ```bash /
```sh block (the whole reply without one), run once as root in the workdir; or, for a task
whose ``[metadata] answer_file`` names a file, that file's content (the reply's last fenced
block, or the whole reply). With ``turns=N`` the model runs commands: each reply's ```bash block
runs and its exit status and output come back; a reply without one (or the N-th) ends the
episode, and the verifier runs. Files persist between commands (the episode's root directory);
processes do not. An ``answer_file`` task is single turn whatever ``turns`` says.

Options: ``path`` (a task or a folder of tasks), ``split`` (``train``; ``test``: tasks marked
``test``, or all when none is marked), ``turns`` (1), ``max_timeout_s`` (120: the most any
phase may take, below the task's own ``timeout_sec``), ``output_chars`` (2000 shown per command),
``reward_key`` (``reward``), ``host_dirs`` (comma-separated host paths bound read-only at the
same place, e.g. a virtual environment whose pytest the tests call), ``memory_mb`` (0: the
task's, else 2048). Metrics: ``reward``, ``correct`` (reward >= 1), ``no_reward``,
``agent_failed`` (non-zero exit), ``agent_timeout``, ``verifier_timeout``, ``commands``,
``setup_s``, ``agent_s``, ``verifier_s``.

``python -m headrace.tasks.harbor DIR`` runs each task's ``solution/solve.sh`` as the answer
(Harbor's oracle) and prints the rewards: a check that a task runs here.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from headrace.core.types import (
    Env,
    EnvGroupBuilder,
    RLDataset,
    SampledTokens,
    StepResult,
    StopCondition,
    Tokens,
)
from headrace.envs.context import EnvContext
from headrace.envs.message import MessageEnv, MessageStep
from headrace.plugins.registry import register_env
from headrace.renderers import Message, Renderer
from headrace.tasks.harbor_format import HarborTask, HarborTaskError, find_tasks
from headrace.tasks.problem_sets import ListDataset
from headrace.tasks.rootfs import run_in_root
from headrace.tasks.sandbox import Limits, ToolResult

SHELL_BLOCK = re.compile(r"```[ \t]*(?:bash|sh|shell|console)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
ANY_BLOCK = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
OPTIONS = {
    "path": "",
    "split": "train",
    "turns": 1,
    "max_timeout_s": 120.0,
    "output_chars": 2000,
    "reward_key": "reward",
    "host_dirs": "",
    "memory_mb": 0,
}


@dataclass
class Workspace:
    """One episode's root directory and its phases: setup, agent commands, the verifier."""

    task: HarborTask
    max_timeout_s: float = 120.0
    reward_key: str = "reward"
    read_only: tuple[str, ...] = ()
    memory_mb: int = 0
    root: Path | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    def limits(self, timeout_s: float) -> Limits:
        seconds = max(1.0, min(timeout_s, self.max_timeout_s))
        memory = self.memory_mb or self.task.memory_mb or 2048
        return Limits(cpu_s=seconds, wall_s=seconds, memory_mb=memory, output_bytes=65_536, file_mb=256,
                      site_packages=False)  # fmt: skip

    async def _run(self, phase: str, command: str, timeout_s: float, env: dict[str, str]) -> ToolResult:
        assert self.root is not None, "prepare() first"
        started = time.perf_counter()
        result = await run_in_root(command, self.root, workdir=self.task.workdir, env=env,
                                   limits=self.limits(timeout_s), read_only=self.read_only)  # fmt: skip
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started
        return result

    async def prepare(self) -> None:
        """A fresh root: the Dockerfile's files copied in, its RUN steps run (network off)."""
        self.close()
        self.seconds = {}
        self.root = Path(tempfile.mkdtemp(prefix="headrace-harbor-"))
        try:
            await self._set_up(self.root)
        except BaseException:
            self.close()
            raise

    async def _set_up(self, root: Path) -> None:
        for sub in (self.task.workdir, "/logs/agent", "/logs/verifier", "/logs/artifacts"):
            (root / sub.lstrip("/")).mkdir(parents=True, exist_ok=True)
        context = self.task.path / "environment"
        for source, dest in self.task.copies:
            src, dst = context / source, root / dest.lstrip("/")
            if not src.exists():
                raise HarborTaskError(f"{self.task.path}: the Dockerfile copies {source}, which environment/ lacks")
            if src.is_dir():
                shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
            else:
                target = dst / src.name if dest.endswith("/") else dst
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target)
        if self.task.setup:
            script = "set -e\n" + "\n".join(self.task.setup)
            result = await self._run("setup", script, self.task.agent_timeout_s, self.task.env)
            if not result.ok:
                said = " | ".join((result.stderr or result.stdout).strip().splitlines())[-400:]
                raise HarborTaskError(
                    f"task {self.task.name}: its Dockerfile's RUN steps failed here (exit {result.exit_code}, "
                    f"{result.killed_reason or 'not killed'}): ...{said}. "
                    "headrace runs Harbor tasks without a container: RUN steps run on the host's tools with the "
                    "network off, so installing packages cannot work; bake what the task needs into the host, "
                    "or pass env_options.host_dirs"
                )

    async def run_agent(self, script: str) -> ToolResult:
        return await self._run("agent", script, self.task.agent_timeout_s, self.task.env)

    def write_answer(self, content: str) -> None:
        assert self.root is not None and self.task.answer_file is not None
        target = self.root / self.task.answer_file.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")

    async def verify(self) -> tuple[float, dict[str, float]]:
        """Harbor's verifier: fresh /tests, no stale reward, test.sh from the workdir, the reward read."""
        assert self.root is not None
        tests, logs = self.root / "tests", self.root / "logs" / "verifier"
        shutil.rmtree(tests, ignore_errors=True)
        shutil.copytree(self.task.tests_dir, tests, symlinks=True)
        (tests / "test.sh").chmod(0o755)
        logs.mkdir(parents=True, exist_ok=True)
        for name in ("reward.json", "reward.txt"):
            (logs / name).unlink(missing_ok=True)
        command = "/tests/test.sh > /logs/verifier/test-stdout.txt 2>&1"
        result = await self._run("verifier", command, self.task.verifier_timeout_s,
                                 self.task.env | self.task.verifier_env)  # fmt: skip
        reward, extra = self._reward(logs)
        metrics = {"verifier_timeout": float(result.timed_out), "no_reward": float(reward is None), **extra}
        return reward or 0.0, metrics

    def _reward(self, logs: Path) -> tuple[float | None, dict[str, float]]:
        if (logs / "reward.json").is_file():
            try:
                values = json.loads((logs / "reward.json").read_text())
            except ValueError:
                return None, {}
            if not isinstance(values, dict):
                values = {self.reward_key: values}
            numbers = {str(k): float(v) for k, v in values.items() if isinstance(v, int | float)}
            extra = {f"reward/{k}": v for k, v in numbers.items() if k != self.reward_key and math.isfinite(v)}
            value = numbers.get(self.reward_key)
            return (value if value is not None and math.isfinite(value) else None), extra
        if (logs / "reward.txt").is_file():
            try:
                value = float((logs / "reward.txt").read_text().strip())
            except ValueError:
                return None, {}
            return (value if math.isfinite(value) else None), {}
        return None, {}

    def test_output(self) -> str:
        path = self.root / "logs" / "verifier" / "test-stdout.txt" if self.root else None
        return path.read_text(errors="replace") if path and path.is_file() else ""

    def close(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, onerror=_writable_then_remove)
            self.root = None


def _writable_then_remove(function: Any, path: str, _: Any) -> None:
    """An agent may leave a directory it made unwritable (chmod 0): open it up and try again."""
    try:
        Path(path).parent.chmod(0o700)
        Path(path).chmod(0o700)
        function(path)
    except OSError:
        pass


def _last(pattern: re.Pattern, text: str) -> str | None:
    blocks = pattern.findall(text)
    return blocks[-1] if blocks else None


def _shown(result: ToolResult, limit: int) -> str:
    status = f"timed out ({result.killed_reason})" if result.timed_out else f"exit code {result.exit_code}"
    output = (result.stdout + result.stderr).strip()
    output = output if len(output) <= limit else "[...]\n" + output[-limit:]
    return f"{status}\n{output}" if output else status


class HarborEnv(MessageEnv):
    def __init__(self, task: HarborTask, renderer: Renderer, max_tokens: int, turns: int = 1,
                 output_chars: int = 2000, **workspace: Any):  # fmt: skip
        super().__init__(renderer, max_tokens, max_turns=turns)
        self.task, self.turns_allowed, self.output_chars = task, turns, output_chars
        self.workspace = Workspace(task, **workspace)
        self.commands = 0
        self.agent_failed = self.agent_timeout = False

    def initial_messages(self) -> Sequence[Message]:
        t = self.task
        if t.answer_file:
            how = f"Reply with the complete content of the file {t.answer_file} in a code block."
        elif self.turns_allowed == 1:
            how = (f"Reply with a bash script in a ```bash code block. It runs once, as root, in {t.workdir}, "
                   "without network access; then your work is checked.")  # fmt: skip
        else:
            how = (f"You can run bash commands: reply with a ```bash code block and you will see its output. They "
                   f"run as root in {t.workdir}, without network access. When you are done, reply without a code "
                   "block; then your work is checked.")  # fmt: skip
        return [{"role": "user", "content": f"{t.instruction}\n\n{how}"}]

    async def initial_observation(self) -> tuple[Tokens, StopCondition]:
        self.commands, self.agent_failed, self.agent_timeout = 0, False, False
        await self.workspace.prepare()
        return await super().initial_observation()

    async def _act(self, script: str) -> ToolResult:
        self.commands += 1
        result = await self.workspace.run_agent(script)
        self.agent_failed |= result.exit_code != 0
        self.agent_timeout |= result.timed_out
        return result

    async def respond(self, text: str, clean: bool) -> MessageStep:
        if self.task.answer_file:
            self.workspace.write_answer(_last(ANY_BLOCK, text) or text)
        elif self.turns_allowed == 1:
            await self._act(_last(SHELL_BLOCK, text) or text)
        else:
            script = _last(SHELL_BLOCK, text)
            if script is not None:
                result = await self._act(script)
                if not self.last_turn:
                    return MessageStep(messages=[_shown(result, self.output_chars)])
        return await self._finish()

    async def _finish(self) -> MessageStep:
        try:
            reward, metrics = await self.workspace.verify()
        finally:
            seconds = dict(self.workspace.seconds)
            self.workspace.close()
        metrics |= {
            "reward": reward,
            "correct": float(reward >= 1.0),
            "agent_failed": float(self.agent_failed),
            "agent_timeout": float(self.agent_timeout),
            "commands": float(self.commands),
            **{f"{phase}_s": seconds.get(phase, 0.0) for phase in ("setup", "agent", "verifier")},
        }
        return MessageStep(reward, done=True, metrics=metrics)

    async def step(self, action: SampledTokens) -> StepResult:
        try:
            return await super().step(action)
        except BaseException:
            self.workspace.close()
            raise


@dataclass
class HarborGroup(EnvGroupBuilder):
    """G episodes of one task; ``cleanup`` removes any root directory an episode left behind."""

    task: HarborTask
    kwargs: dict[str, Any]
    group_size: int
    envs: list[HarborEnv] = field(default_factory=list, repr=False, compare=False)

    async def make_envs(self) -> Sequence[Env]:
        self.envs = [HarborEnv(self.task, **self.kwargs) for _ in range(self.group_size)]
        return self.envs

    async def cleanup(self) -> None:
        for env in self.envs:
            env.workspace.close()

    def logging_tags(self) -> list[str]:
        return ["harbor", self.task.name]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "envs": []}  # live workspaces stay where they run


def _workspace_options(options: dict[str, Any]) -> dict[str, Any]:
    return {
        "max_timeout_s": options["max_timeout_s"],
        "reward_key": options["reward_key"],
        "read_only": tuple(p.strip() for p in options["host_dirs"].split(",") if p.strip()),
        "memory_mb": options["memory_mb"],
    }


@register_env("harbor", options=OPTIONS)
def make_dataset(ctx: EnvContext) -> RLDataset:
    """Harbor task directories (env_options.path): the answer runs in a no-network root, tests/test.sh rewards."""
    options = ctx.options
    if not options["path"]:
        raise ValueError("the harbor env needs env_options.path: a Harbor task directory or a folder of them")
    if options["turns"] < 1 or options["max_timeout_s"] <= 0:
        raise ValueError(f"the harbor env needs turns >= 1 and max_timeout_s > 0 (got {options})")
    tasks = find_tasks(options["path"])
    split, held_out = options["split"], [t for t in tasks if t.split == "test"]
    chosen = [t for t in tasks if t.split != "test"] if split == "train" else held_out or tasks
    if not chosen:
        raise ValueError(f"no Harbor task under {options['path']} is in the {split} split")
    renderer = ctx.renderer
    kwargs = {"renderer": renderer, "max_tokens": ctx.max_tokens, "turns": options["turns"],
              "output_chars": options["output_chars"], **_workspace_options(options)}  # fmt: skip

    def group(task: HarborTask) -> HarborGroup:
        return HarborGroup(task, kwargs, ctx.group_size)

    if split == "test":
        return ListDataset(chosen, group, ctx.batch_size)
    return ListDataset(chosen, group, ctx.batch_size, num_batches=max(ctx.steps, 1), seed=ctx.seed)


async def oracle(task: HarborTask, **options: Any) -> tuple[float, dict[str, float], str]:
    """Run the task's ``solution/solve.sh`` as the answer (at ``/solution``, as Harbor's
    OracleAgent does), then the verifier: the reward, the metrics and the tests' output."""
    if task.solution is None:
        raise HarborTaskError(f"{task.path} has no solution/solve.sh")
    workspace = Workspace(task, **options)
    await workspace.prepare()
    try:
        assert workspace.root is not None
        shutil.copytree(task.solution.parent, workspace.root / "solution", symlinks=True)
        result = await workspace.run_agent("bash /solution/solve.sh")
        if not result.ok:
            return 0.0, {"agent_failed": 1.0}, result.stdout + result.stderr
        reward, metrics = await workspace.verify()
        return reward, metrics, workspace.test_output()
    finally:
        workspace.close()


async def _main(paths: list[str]) -> int:
    worst = 1.0
    for path in paths:
        for task in find_tasks(path):
            reward, metrics, output = await oracle(task)
            worst = min(worst, reward)
            print(f"{task.name}: reward {reward:g} {json.dumps(metrics)}")
            if reward < 1.0:
                print("  " + output.strip().replace("\n", "\n  ")[-1500:])
    return 0 if worst >= 1.0 else 1


if __name__ == "__main__":
    sys.exit(anyio.run(_main, sys.argv[1:] or ["examples/harbor_tasks"]))


__all__ = ["HarborEnv", "HarborGroup", "Workspace", "make_dataset", "oracle"]
