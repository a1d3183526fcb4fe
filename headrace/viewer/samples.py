"""A sample of each step's trajectories, as text, to ``RUN_DIR/rollouts/step_NNNNNN.jsonl``.

Which trajectories are kept does not depend on the order groups finish in (async schedulers
finish them in any order): the groups with the lowest indices in their batch, and in each the
highest- and lowest-reward members. A write that fails (full disk, a tokenizer that cannot decode)
is logged and counted, never raised: seeing samples must not cost a run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

from headrace.core.files import LinkRefused, open_no_follow
from headrace.core.logs import get_logger
from headrace.core.types import GroupKey, Tokenizer, Trajectory

log = get_logger()

MAX_TEXT = 4000  # characters kept of one prompt, completion or turn
MAX_FILE_BYTES = 256 * 1024  # lines past this are not written for the step
OPEN_FILES = 4  # steps whose files stay open between groups


class SampleGroup(NamedTuple):
    """One finished group, as the writer takes it (a plain 3- or 4-tuple works as well)."""

    key: GroupKey
    trajectories: Sequence[Trajectory]
    rewards: Sequence[float]
    advantages: Sequence[float] | None = None


class RolloutSampleWriter:
    """``write(step, groups)`` appends up to ``per_step`` trajectories of ``step`` to its file.

    ``per_step`` trajectories come from ``ceil(per_step / members)`` groups (those with index below
    that), ``members`` (2: best and worst) of each. It may be called once per step with every
    group or once per group as groups finish; ``per_step=0`` writes nothing.
    """

    def __init__(self, run_dir: str | Path, per_step: int, tokenizer: Tokenizer, members: int = 2):
        self.dir = Path(run_dir) / "rollouts"
        self.per_step, self.tokenizer, self.members = per_step, tokenizer, max(1, members)
        self.groups_per_step = math.ceil(per_step / self.members) if per_step > 0 else 0
        self.failures = 0
        self._bytes: dict[int, int] = {}  # step -> bytes written to its file by this writer
        self._open: dict[int, IO[str]] = {}  # step -> its file, for the last OPEN_FILES steps written
        self._made_dir = False

    def path(self, step: int) -> Path:
        return self.dir / f"step_{step:06d}.jsonl"

    def write(self, step: int, groups: Iterable[SampleGroup | tuple]) -> int:
        """Write the sampled members of ``groups`` for ``step``; returns how many lines were written."""
        try:
            lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in self._records(step, groups)]
            return self._append(step, lines) if lines else 0
        except Exception as e:  # noqa: BLE001 - samples are a view; the run goes on without them
            self._drop(step)
            self.failures += 1
            log.warning(
                "rollout_samples_not_written",
                step=step,
                path=str(self.path(step)),
                error=f"{type(e).__name__}: {e}",
                failures=self.failures,
            )
            return 0

    def _records(self, step: int, groups: Iterable[SampleGroup | tuple]) -> list[dict[str, Any]]:
        records = []
        for group in sorted((SampleGroup(*g) for g in groups), key=lambda g: g.key.index):
            if group.key.index >= self.groups_per_step:
                continue
            take = min(self.members, self.per_step - group.key.index * self.members)
            for member in pick_members(group.rewards, take):
                records.append(self._record(step, group, member))
        return records

    def _record(self, step: int, group: SampleGroup, member: int) -> dict[str, Any]:
        traj = group.trajectories[member]
        turns = self._turns(traj)
        prompt = turns[0]["observation"] if turns else ""
        completion = "".join((t["observation"] if i else "") + t["action"] for i, t in enumerate(turns))
        return {
            "step": step,
            "batch": group.key.batch,
            "group": group.key.index,
            "member": member,
            "group_size": len(group.trajectories),
            "reward": _number(group.rewards[member]),
            "group_rewards": [_number(r) for r in group.rewards],
            "advantage": _number(group.advantages[member]) if group.advantages is not None else None,
            "policy_version": traj.policy_version,
            # why the completion ended (stop, length, context_overflow), and why the episode did
            "stop_reason": str(traj.transitions[-1].action.stop_reason) if traj.transitions else "",
            "episode_end": str(traj.stop_reason),
            "prompt": _clip(prompt),
            "completion": _clip(completion),
            "turns": [{**t, "observation": _clip(t["observation"]), "action": _clip(t["action"])} for t in turns]
            if len(turns) > 1
            else [],
            "prompt_tokens": len(traj.transitions[0].observation) if traj.transitions else 0,
            "completion_tokens": traj.num_action_tokens,
        }

    def _turns(self, traj: Trajectory) -> list[dict[str, Any]]:
        """Each turn's new observation tokens (all of them for the first, or when a turn does not
        extend the last one's prompt + action) and its action, decoded."""
        turns: list[dict[str, Any]] = []
        context: list[int] = []
        for t in traj.transitions:
            obs = t.observation
            delta = obs[len(context) :] if obs[: len(context)] == context else obs
            turns.append(
                {
                    "observation": self._decode(delta),
                    "action": self._decode(t.action.tokens),
                    "reward": _number(t.reward),
                    "stop_reason": str(t.action.stop_reason),
                    "policy_version": t.action.policy_version,
                }
            )
            context = list(obs) + list(t.action.tokens)
        return turns

    def _decode(self, tokens: Sequence[int]) -> str:
        try:
            return self.tokenizer.decode(list(tokens))
        except Exception as e:  # noqa: BLE001 - show the ids rather than lose the sample
            return f"<undecodable {type(e).__name__}: {list(tokens)[:64]}>"

    def _append(self, step: int, lines: list[str]) -> int:
        used = self._bytes.get(step, 0)
        written = 0
        f = self._file(step)
        for line in lines:
            size = len(line.encode())
            if used + size > MAX_FILE_BYTES:
                log.warning("rollout_samples_file_full", step=step, limit_bytes=MAX_FILE_BYTES)
                break
            f.write(line)
            f.flush()  # each line whole on disk as soon as it is written, like metrics.jsonl
            used += size
            written += 1
        self._bytes[step] = used
        return written

    def _file(self, step: int) -> IO[str]:
        """The step's file, opened once and kept open while its step is among the last few written:
        opening it for each group cost more than the rest of the engine's per-step work on a slow disk."""
        f = self._open.get(step)
        if f is not None:
            return f
        # A step this writer has not written yet starts its file afresh: lines left by a run that
        # trained the step before it crashed (and was resumed) are replaced, not doubled.
        mode = "a" if step in self._bytes else "w"
        path = self.path(step)
        if not self._made_dir:  # once: a mkdir and a stat per step cost as much as the step's other work here
            self.dir.mkdir(parents=True, exist_ok=True)
            self._made_dir = True
        try:
            f = open_no_follow(path, mode, encoding="utf-8")
        except LinkRefused:
            if mode == "a":
                raise
            path.unlink()  # replaced, as the file would be: never written through
            f = open_no_follow(path, mode, encoding="utf-8")
        except FileNotFoundError:  # the folder went away during the run
            self.dir.mkdir(parents=True, exist_ok=True)
            f = open_no_follow(path, mode, encoding="utf-8")
        self._bytes.setdefault(step, 0)
        self._open[step] = f
        while len(self._open) > OPEN_FILES:  # async schedulers write a few steps at once
            self._open.pop(min(self._open)).close()
        return f

    def _drop(self, step: int) -> None:
        f = self._open.pop(step, None)
        if f is not None:
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def pick_members(rewards: Sequence[float], k: int) -> list[int]:
    """The indices of the best and the worst member, then alternately the next best and worst;
    ties go to the lower index, so the choice is the same on every run."""
    best = sorted(range(len(rewards)), key=lambda i: (-_sortable(rewards[i]), i))
    worst = sorted(range(len(rewards)), key=lambda i: (_sortable(rewards[i]), i))
    picked: list[int] = []
    while len(picked) < min(k, len(rewards)):
        source = best if len(picked) % 2 == 0 else worst
        picked.append(next(i for i in source if i not in picked))
    return picked


def _sortable(x: float) -> float:
    return x if isinstance(x, int | float) and math.isfinite(x) else -math.inf


def _number(x: Any) -> float | None:
    """JSON has no NaN or infinity: a non-finite value is written as null."""
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + f"… [{len(text) - MAX_TEXT} more characters]"
