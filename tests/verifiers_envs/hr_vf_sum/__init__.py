"""hr_vf_sum: add two numbers, one turn (a headrace test environment)."""

from typing import Literal

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str
    fail: bool = False


class SumTask(vf.Task[SumData]):
    @vf.stop
    async def one_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if self.data.fail:
            raise RuntimeError("the rubric broke")
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.metric
    async def length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumConfig(vf.TasksetConfig):
    split: Literal["train", "test"] = "train"
    fail: bool = False  # the reward raises: an episode verifiers reports failed


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        pairs = [(a, b) for a in range(8) for b in range(6)]
        chosen = pairs[:40] if self.config.split == "train" else pairs[40:]
        return [
            SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b), fail=self.config.fail), self.config.task)
            for a, b in chosen
        ]


__all__ = ["SumTaskset"]
