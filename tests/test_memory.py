"""Bounded memory over a long run: what the code could get wrong, measured from the outside.

Admission bounds the work in flight: at most lag + 2 batches are alive at once (lag + 1 admitted
and untrained, and the one being reported), so the live groups and trajectories, counted by the
garbage collector, stay under that however long the run; and the bytes still held from what a
step allocated (tracemalloc, started mid-run) do not grow with the steps.
"""

from __future__ import annotations

import gc
import statistics
import tracemalloc

import pytest
from helpers import sim_config

from headrace.engine.reward import ProcessedGroup
from headrace.engine.run import train
from headrace.engine.types import Datum, Trajectory

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

LAG, BATCH, GROUP, STEPS = 2, 8, 4, 800
TRACE_FROM = 200  # steps before tracing starts: queues and buffers have reached their working size
BYTES_PER_STEP = 1024  # a leaked metrics row is ~2.6 KB a step, a leaked batch of groups far more


def live_counts() -> dict[str, int]:
    counts = dict.fromkeys(("ProcessedGroup", "Trajectory", "Datum"), 0)
    for obj in gc.get_objects():
        if type(obj) in (ProcessedGroup, Trajectory, Datum):
            counts[type(obj).__name__] += 1
    return counts


async def test_live_work_stays_within_admission_and_memory_stays_flat(tmp_path):
    config = sim_config(
        tmp_path, scheduler="async", max_steps_off_policy=LAG, steps=STEPS, batch_size=BATCH, group_size=GROUP,
        # a slow learner, so the queues back up; the sim's own records kept short, so they don't count
        set={"sim.train_step_s": 0.002, "advantages.filter_constant": "false", "sim.record_limit": 64},
    )
    counts: dict[int, dict[str, int]] = {}
    traced: dict[int, int] = {}

    def on_step(row):
        step = row["step"]
        if step % 50 == 0:
            counts[step] = live_counts()
        if step == TRACE_FROM:
            tracemalloc.start()
        elif step > TRACE_FROM and step % 25 == 0 and step < STEPS - 25:  # not the drain at the end
            traced[step] = tracemalloc.get_traced_memory()[0]

    try:
        summary = await train(config, on_step=on_step)
    finally:
        tracemalloc.stop()
    assert summary.steps == STEPS

    in_flight = (LAG + 2) * BATCH
    worst = {name: max(c[name] for c in counts.values()) for name in ("ProcessedGroup", "Trajectory", "Datum")}
    print(f"most alive at once: {worst}; bound {in_flight} groups")
    assert worst["Trajectory"] > 0 and worst["ProcessedGroup"] > 0, "nothing was counted: the probe is broken"
    assert worst["ProcessedGroup"] <= in_flight, f"processed groups pile up: {counts}"
    assert worst["Trajectory"] <= in_flight * GROUP, f"trajectories pile up past admission: {counts}"
    assert worst["Datum"] <= in_flight * GROUP, f"datums pile up: {counts}"

    slope = statistics.linear_regression(list(traced), list(traced.values())).slope
    print(f"memory held from the traced steps grows {slope:.0f} B/step ({traced})")
    assert slope < BYTES_PER_STEP, f"memory grows with the steps: {slope:.0f} B/step over steps {min(traced)}-{max(traced)}"
