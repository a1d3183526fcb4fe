"""Small builders shared by the engine tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from headrace.core.trace import Event, RunStarted
from headrace.run.config import build_config
from headrace.run.train import RunSummary, train


@dataclass
class Traced:
    """A tracer keeping every event, and the backend the run opened (for its recorded timeline)."""

    events: list[Event] = field(default_factory=list)
    backend: Any = None

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, RunStarted):
            self.backend = event.backend


@dataclass
class TracedRun:
    """A run's summary with its trace: ``.backend`` is the backend it ran on."""

    summary: RunSummary
    trace: Traced

    @property
    def backend(self) -> Any:
        return self.trace.backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self.summary, name)


async def traced_train(config, **kwargs: Any) -> TracedRun:
    trace = Traced()
    return TracedRun(await train(config, tracer=trace, **kwargs), trace)


def sim_config(tmp_path, **flags: Any):
    base = dict(backend="sim", steps=6, batch_size=4, group_size=4, run_dir=str(tmp_path / "run"), progress=False)
    base |= flags
    overrides = [f"{k}={v}" for k, v in base.pop("set", {}).items()]
    return build_config(flags=base, overrides=overrides)


async def run_sim(tmp_path, dataset=None, **flags: Any) -> TracedRun:
    return await traced_train(sim_config(tmp_path, **flags), dataset=dataset)


def run_argv(
    *extra: str, run_dir=None, progress: bool = False, set: dict[str, Any] | None = None, **flags: Any
) -> list[str]:
    """`headrace run` argv: a short sim run unless told otherwise.

    Each keyword is a flag (`batch_size=8` -> `--batch-size 8`; None leaves it out), each `set` item a
    `--set key=value`, and `extra` goes last, as it is.
    """
    flags = dict(backend="sim", steps=3, batch_size=2, group_size=4) | flags
    argv = ["run"]
    for name, value in flags.items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    for key, value in (set or {}).items():
        argv += ["--set", f"{key}={value}"]
    if run_dir is not None:
        argv += ["--run-dir", str(run_dir)]
    if not progress:
        argv.append("--no-progress")
    return [*argv, *extra]
