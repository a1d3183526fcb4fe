"""hr_vf_calc: add two numbers with a calculator tool, several turns (a headrace test environment)."""

import verifiers.v1 as vf

from hr_vf_calc.tools import CalcToolset


class CalcData(vf.TaskData):
    answer: str


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.stop
    async def enough(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 3

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in trace.last_reply)

    @vf.metric
    async def called(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))


class CalcConfig(vf.TasksetConfig):
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self) -> list[CalcTask]:
        return [
            CalcTask(CalcData(prompt=f"add {a} and {b}", answer=str(a + b)), self.config.task)
            for a in range(10, 40, 3)
            for b in range(5, 9)
        ]


__all__ = ["CalcTaskset"]
