"""A program as the agent: run once per episode, with the endpoint in its environment.

The program gets ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``OPENAI_MODEL`` (what the OpenAI SDKs
read) and ``HEADRACE_PROBLEM`` (the problem as JSON), and prints its outcome as its last line of
output: a number (the reward) or a JSON object ``{"reward": ..., "answer": ..., "metrics": {...}}``
(an ``answer`` without a reward is scored by ``grade``). A program that exits non-zero, or is still
running when its episode ends (a timeout, its group giving up), is killed and counts as the
episode's error.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import anyio

from headrace.core.errors import EnvError

from .env import AgentEpisode, AgentResult

OUTPUT_LIMIT = 1 << 20  # what of a program's output is kept


class AgentCommandError(EnvError, RuntimeError):
    """The agent program failed: it exited non-zero or printed no outcome."""


@dataclass(frozen=True)
class CommandAgent:
    argv: tuple[str, ...]
    cwd: str | None = None

    async def __call__(self, episode: AgentEpisode) -> AgentResult:
        env = {**os.environ, **episode.environment(), "HEADRACE_PROBLEM": json.dumps(episode.problem)}
        proc = await asyncio.create_subprocess_exec(
            *self.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=self.cwd
        )
        try:
            out, err = await proc.communicate()
        finally:
            if proc.returncode is None:  # cancelled (a timeout, the group gave up): it ends with its episode
                proc.kill()
                with anyio.CancelScope(shield=True):
                    await proc.wait()
        name = " ".join(self.argv)
        if proc.returncode != 0:
            tail = err[-OUTPUT_LIMIT:].decode(errors="replace").strip().splitlines()[-3:]
            raise AgentCommandError(f"the agent '{name}' exited with status {proc.returncode}: {' | '.join(tail)}")
        lines = out[-OUTPUT_LIMIT:].decode(errors="replace").strip().splitlines()
        if not lines:
            raise AgentCommandError(f"the agent '{name}' printed nothing; its last line must be its reward")
        return outcome_of(lines[-1], name)


def outcome_of(line: str, name: str) -> AgentResult:
    try:
        value = json.loads(line)
    except ValueError:
        raise AgentCommandError(
            f"the agent '{name}' ended with {line!r:.80}; its last line must be a number or a JSON object "
            '{"reward": ..., "answer": ..., "metrics": {...}}'
        ) from None
    if isinstance(value, dict):
        return AgentResult(value.get("reward"), value.get("answer"), dict(value.get("metrics") or {}))
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AgentCommandError(f"the agent '{name}' ended with {line!r:.80}, which is no reward (a number)")
    return AgentResult(float(value))


def command_agent(argv: Sequence[str] | str, cwd: str | None = None) -> CommandAgent:
    """The agent that runs ``argv`` (a list, or a string split as a shell would) for each episode."""
    import shlex

    return CommandAgent(tuple(shlex.split(argv) if isinstance(argv, str) else argv), cwd)
