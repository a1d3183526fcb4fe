"""The run's event stream: what an observer (the bench harness, the live display, your own) sees.

``headrace.train(config, tracer=...)`` calls the tracer with each event as it happens, on the
event loop, in the order things happened. A tracer must be quick and must not raise: what it
raises fails the run (an observer that hides its own errors would hide wrong figures). With no
tracer, nothing is built or called.

Times are ``time.perf_counter()`` seconds. A sample call carries the rollout it served,
``(batch, group, member)`` with member -1 for a group's shared first sample and ``None`` outside
a rollout (an evaluation); the k-th completed call of an op is the k-th one its backend finished.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from headrace.core.protocols import Backend

Rollout = tuple[int, int, int]  # (batch, group index, member); member -1 = the group's shared first sample


@dataclass(frozen=True, slots=True)
class RunStarted:
    run_dir: str
    start_step: int  # where this process starts (the resumed checkpoint's step, else 0)
    steps: int  # the run's last step + 1
    backend: Backend  # what the run trains and samples with, entered and ready
    at: float


@dataclass(frozen=True, slots=True)
class RolloutStarted:
    rollout: Rollout  # member -1: the whole group
    at: float


@dataclass(frozen=True, slots=True)
class RolloutFinished:
    rollout: Rollout
    dropped: bool  # the group spent its retry budget
    at: float


@dataclass(frozen=True, slots=True)
class CallSubmitted:
    op: str  # "sample" | "forward_backward" | "optim_step" | "publish"
    call: int  # numbered per op, from 0, in submission order
    rollout: Rollout | None
    at: float


@dataclass(frozen=True, slots=True)
class CallCompleted:
    op: str
    call: int
    rollout: Rollout | None
    at: float
    ok: bool = True  # False: the backend raised (a transient error is then retried as a new call)
    tokens: int = 0  # sample: tokens sampled, all n samples


@dataclass(frozen=True, slots=True)
class StepPublished:
    step: int
    version: int  # the weights the sampler now uses
    row: dict[str, Any] = field(repr=False)  # the step's metrics row, as written to metrics.jsonl
    at: float = 0.0


Event = RunStarted | RolloutStarted | RolloutFinished | CallSubmitted | CallCompleted | StepPublished
Tracer = Callable[[Event], None]

# the rollout running in this task, set by the rollout actor, read when a sample call is traced
current_rollout: ContextVar[Rollout | None] = ContextVar("headrace_current_rollout", default=None)


def fan_out(*tracers: Tracer | None) -> Tracer | None:
    """One tracer calling each of ``tracers`` in turn (None ones skipped); None if none is left."""
    live = [t for t in tracers if t is not None]
    if len(live) <= 1:
        return live[0] if live else None

    def each(event: Event) -> None:
        for tracer in live:
            tracer(event)

    return each


class CallCounter:
    """Numbers the calls of each op in submission order."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def take(self, op: str) -> int:
        call = self._next.get(op, 0)
        self._next[op] = call + 1
        return call
