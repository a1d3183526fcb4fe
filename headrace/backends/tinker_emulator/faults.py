"""The emulator's knobs: latency, lock-step clock cycles and injected faults. Deterministic:
faults fire on counters (every Nth request), never on a random draw, so a test that sets one
sees it at the same place every run."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class Knobs:
    latency_s: float = 0.0  # server time added to every training op
    sample_latency_s: float = 0.0  # server time added to every sample request
    clock_cycle_s: float = 0.0  # lock-step cycles: training ops start only at cycle boundaries; 0 = off
    follow_s: float = 0.05  # a model's op arriving this soon after its previous one joins that op's cycle
    long_poll_s: float = 10.0  # retrieve_future holds a pending request this long before try_again
    try_again_polls: int = 0  # every future answers try_again this many times before its result
    http_5xx_every: int = 0  # every Nth POST to an op endpoint starts a burst of 503s ...
    http_5xx_burst: int = 1  # ... of this many consecutive responses
    http_5xx_ops: tuple[str, ...] = ("forward_backward", "optim_step", "create_model")  # where bursts land
    drop_every: int = 0  # every Nth training submission is queued, then its response is dropped
    drop_fetch_every: int = 0  # every Nth retrieve_future of a finished result is dropped
    fail_after_apply_every: int = 0  # every Nth optim_step is applied, then reported as a server error
    stall_every: int = 0  # every Nth optim_step is applied, then its result is held back for stall_s
    stall_s: float = 3600.0
    retry_after_ms: int = 20  # sent with 503s so the SDK's backoff stays short in tests

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> Knobs:
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown emulator knob(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**values)  # type: ignore[arg-type]


class FaultPlan:
    """Counts requests and says which ones to fault."""

    def __init__(self, knobs: Knobs):
        self.knobs = knobs
        self._posts = 0
        self._burst_left = 0
        self._submissions = 0
        self._fetches = 0
        self._optims = 0
        self._stalls = 0

    def http_5xx(self) -> bool:
        k = self.knobs
        if not k.http_5xx_every:
            return False
        if self._burst_left > 0:
            self._burst_left -= 1
            return True
        self._posts += 1
        if self._posts % k.http_5xx_every == 0:
            self._burst_left = max(k.http_5xx_burst, 1) - 1
            return True
        return False

    def drop_submission(self) -> bool:
        self._submissions += 1
        every = self.knobs.drop_every
        return bool(every) and self._submissions % every == 0

    def drop_fetch(self) -> bool:
        self._fetches += 1
        every = self.knobs.drop_fetch_every
        return bool(every) and self._fetches % every == 0

    def fail_after_apply(self, op: str) -> bool:
        if op != "optim_step":
            return False
        self._optims += 1
        every = self.knobs.fail_after_apply_every
        return bool(every) and self._optims % every == 0

    def stall(self, op: str) -> bool:
        if op != "optim_step" or not self.knobs.stall_every:
            return False
        self._stalls += 1
        return self._stalls % self.knobs.stall_every == 0
