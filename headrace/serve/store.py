"""Capture: every completion served, with what trains on it, and the feedback it gets.

``D/completions.jsonl`` holds one line per completion (written before the response leaves, so an
id a client holds is always known), ``D/feedback.jsonl`` one line per reward. Both are read back
on ``--resume``; a last line cut short by kill -9 is skipped, and cut off before the next record is
appended (``headrace.core.files.AppendLog``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from headrace.core import logs
from headrace.core.errors import RequestError
from headrace.core.files import AppendLog

log = logs.get_logger()

COMPLETIONS, FEEDBACK = "completions.jsonl", "feedback.jsonl"
# float32's range (±3.4e38) with room for a reward minus its baseline (or its group's mean), which trains
REWARD_LIMIT = 1e38


def reward_problem(reward: Any) -> str | None:
    """Why ``reward`` cannot train (None: it can); a huge integer is compared exactly, never converted."""
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        return f"needs a number as 'reward', got {reward!r}"[:300]
    if not -REWARD_LIMIT <= reward <= REWARD_LIMIT:  # NaN fails this too
        shown = f"{reward:.3g}" if isinstance(reward, float) else f"an integer of {len(str(abs(reward)))} digits"
        return f"has 'reward' {shown}, outside the accepted range -1e38 to 1e38 (float32's, with room for advantages)"
    return None


@dataclass
class Completion:
    id: str
    version: int  # the policy version that sampled it
    epoch: int  # the version chain's line that made that version the incumbent
    prompt_tokens: list[int]  # rendered with the model's chat template (the envs' renderer)
    completion_tokens: list[int]
    logprobs: list[float]  # the sampler's own, one per completion token
    finish_reason: str
    text: str
    scenario: str | None = None
    created: float = field(default_factory=time.time)
    reward: float | None = None

    def record(self) -> dict[str, Any]:
        out = asdict(self)
        del out["reward"]
        return out


class FeedbackError(RequestError):
    """A feedback item the service refuses: ``status`` is the HTTP answer (404 unknown id, 409 scored)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Store:
    def __init__(self, run_dir: Path):
        self.completions: dict[str, Completion] = {}
        self._out = AppendLog(run_dir / COMPLETIONS)
        self._feedback_out = AppendLog(run_dir / FEEDBACK)
        for record in self._out.read():
            self.completions[record["id"]] = Completion(**record)
        for record in self._feedback_out.read():
            if record["id"] in self.completions:
                if problem := reward_problem(record.get("reward")):  # an older version's, or written by hand
                    log.warning("serve_skipped_reward", file=str(run_dir / FEEDBACK), id=record["id"], problem=problem)
                    continue
                self.completions[record["id"]].reward = float(record["reward"])
        self._out.open()  # open for the service's life, a torn last line cut
        self._feedback_out.open()

    def close(self) -> None:
        self._out.close()
        self._feedback_out.close()

    def add(self, completion: Completion) -> None:
        # written through to the kernel: kill -9 cannot lose it (only a machine crash could)
        self._out.append(completion.record())
        self.completions[completion.id] = completion

    def check_feedback(self, cid: Any, reward: Any) -> tuple[Completion, float]:
        """The completion an item scores and its reward, or ``FeedbackError`` saying why not."""
        if not isinstance(cid, str):
            raise FeedbackError(400, f"a feedback item needs an 'id' string (a completion's id), got {cid!r}")
        if problem := reward_problem(reward):
            raise FeedbackError(400, f"feedback for '{cid}' {problem}")
        completion = self.completions.get(cid)
        if completion is None:
            raise FeedbackError(404, f"no completion with id '{cid}' was served here")
        if completion.reward is not None:
            raise FeedbackError(409, f"completion '{cid}' already has a reward ({completion.reward}); each gets one")
        return completion, float(reward)

    def score(self, completion: Completion, reward: float) -> None:
        self._feedback_out.append({"id": completion.id, "reward": reward, "time": time.time()})
        completion.reward = reward
