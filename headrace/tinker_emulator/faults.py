"""The emulator's knobs: latency, lock-step clock cycles, injected faults and the server's
limits. Deterministic: faults fire on counters (every Nth request), never on a random draw, so a
test that sets one sees it at the same place every run. Every value is validated (type, range)
when set, at start or through ``POST /emulator/knobs``: a bad one is refused, never stored."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import pydantic
from pydantic import Field

Seconds = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
Count = Annotated[int, Field(strict=True, ge=0)]


@pydantic.dataclasses.dataclass
class Knobs:
    latency_s: Seconds = 0.0  # server time added to every training op
    sample_latency_s: Seconds = 0.0  # server time added to every sample request
    clock_cycle_s: Seconds = 0.0  # lock-step cycles: training ops start only at cycle boundaries; 0 = off
    # a model's op arriving this soon after its previous one joins that op's (closed) cycle; 0 = hard
    # boundaries, as the service promises: an op that arrives after a boundary waits for the next one
    follow_s: Seconds = 0.0
    # at most this many forward/forward_backward/optim_step ops per model per cycle (2 = one
    # forward_backward + optim_step pair); the rest of that model's queue waits, in order; 0 = no cap
    max_ops_per_cycle: Count = 0
    long_poll_s: Seconds = 10.0  # retrieve_future holds a pending request this long before try_again
    try_again_polls: Count = 0  # every future answers try_again this many times before its result
    http_5xx_every: Count = 0  # every Nth POST to an op endpoint starts a burst of 503s ...
    http_5xx_burst: Count = 1  # ... of this many consecutive responses
    http_5xx_ops: tuple[str, ...] = ("forward_backward", "optim_step", "create_model")  # where bursts land
    drop_every: Count = 0  # every Nth training submission is queued, then its response is dropped
    drop_fetch_every: Count = 0  # every Nth retrieve_future of a finished result is dropped
    fail_after_apply_every: Count = 0  # every Nth optim_step is applied, then reported as a server error
    stall_every: Count = 0  # every Nth optim_step is applied, then its result is held back for stall_s
    stall_s: Seconds = 3600.0
    nan_loss_every: Count = 0  # every Nth forward_backward reports a NaN loss, its step marked (bigram: NaN gradient)
    retry_after_ms: Count = 20  # sent with 503s so the SDK's backoff stays short in tests
    # limits: what a long-lived server keeps, and what it accepts
    future_grace_s: Seconds = 300.0  # a future is forgotten this long after its result was first fetched
    session_ttl_s: Seconds = 900.0  # a session (and its models) idle this long is evicted; so is a sampling session
    idle_connection_s: Seconds = 30.0  # a keep-alive connection with no request this long is closed
    header_timeout_s: Seconds = 10.0  # a request's line and headers must arrive within this (slowloris)
    max_connections: Annotated[int, Field(strict=True, ge=1)] = 1024  # served at once (fewer if ulimit -n says so)
    max_body_mib: Seconds = 32.0  # a larger request body is answered 413
    log_records: Count = 200_000  # the newest request-log records kept for /emulator/log (the --log file has all)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Knobs:
        return cls().updated(values)

    def updated(self, values: Any) -> Knobs:
        """A validated copy with ``values`` applied; ``ValueError`` names every bad or unknown key."""
        if not isinstance(values, dict):
            raise ValueError(f"knobs must be a JSON object of name: value, not {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown emulator knob(s) {unknown}; known: {sorted(known)}")
        try:
            return dataclasses.replace(self, **values)
        except pydantic.ValidationError as e:
            bad = "; ".join(f"{'.'.join(map(str, err['loc']))}={err['input']!r}: {err['msg']}" for err in e.errors())
            raise ValueError(f"bad emulator knob value(s): {bad}") from None

    def set_from(self, other: Knobs) -> None:
        """Take ``other``'s values in place: the fault plan, the ops and the server share this object."""
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, getattr(other, f.name))


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
        self._forward_backwards = 0

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

    def nan_loss(self) -> bool:
        self._forward_backwards += 1
        every = self.knobs.nan_loss_every
        return bool(every) and self._forward_backwards % every == 0

    def stall(self, op: str) -> bool:
        if op != "optim_step" or not self.knobs.stall_every:
            return False
        self._stalls += 1
        return self._stalls % self.knobs.stall_every == 0
