"""Bounded memory over a long run: what the code could get wrong, measured from the outside.

Admission bounds the work in flight: when step k is reported, batches k+1 … k+1+lag may be admitted
and untrained, so at most lag + 1 batches are trajectories (and one group the reward actor has just
turned into datums), and lag + 2 batches are processed groups (with batch k's, in the report).
The live objects, counted by the garbage collector, stay under that however long the run, and the
bytes still held from what later steps allocated (tracemalloc, started mid-run) do not grow.
"""

from __future__ import annotations

import gc
import statistics
import tracemalloc
from pathlib import Path

import pytest
from helpers import sim_config

from headrace.core import learner, sampler
from headrace.core.advantage_actor import ProcessedGroup
from headrace.core.types import Datum, Trajectory
from headrace.run.train import train

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

LAG, BATCH, GROUP, STEPS = 2, 8, 4, 650
# tracing starts once the queues have reached their working size; the bytes it sees then rise by
# the work in flight (allocated anew) for a hundred steps or so, so the fit starts later
TRACE_FROM, FIT_FROM = 100, 250
BYTES_PER_STEP = 1024  # a leaked metrics row is ~2.7 KB a step, a leaked batch of groups far more


def benchmark_lines() -> list[tracemalloc.Filter]:
    """The actors' busy-time spans (for the benchmarks' timelines) grow, 2 floats a step, up to
    their bound of 10,000; they are left out so the slope shows what else is kept."""
    filters = []
    for module in (learner, sampler):
        for number, line in enumerate(Path(module.__file__).read_text().splitlines(), 1):
            if "busy_s" in line or "perf_counter" in line:
                filters.append(tracemalloc.Filter(False, module.__file__, number))
    return filters


def live_counts() -> dict[str, int]:
    gc.collect()  # what is unreachable is not alive, even when a cycle keeps it until a collection
    counts = dict.fromkeys(("ProcessedGroup", "Trajectory", "Datum"), 0)
    for obj in gc.get_objects():
        if type(obj) in (ProcessedGroup, Trajectory, Datum):
            counts[type(obj).__name__] += 1
    return counts


async def test_live_work_stays_within_admission_and_memory_stays_flat(tmp_path):
    config = sim_config(
        tmp_path,
        scheduler="async",
        max_steps_off_policy=LAG,
        steps=STEPS,
        batch_size=BATCH,
        group_size=GROUP,
        # a slow learner, so the queues back up; the sim's own records kept short, so they don't count
        set={"sim.train_step_s": 0.002, "advantages.filter_constant": "false", "sim.record_limit": 64},
    )
    bound = {
        "Trajectory": ((LAG + 1) * BATCH + 1) * GROUP,
        "ProcessedGroup": (LAG + 2) * BATCH,
        "Datum": (LAG + 2) * BATCH * GROUP,
    }
    counts: dict[int, dict[str, int]] = {}
    traced: dict[int, int] = {}
    ignored = benchmark_lines()

    def on_step(row):
        step = row["step"]
        if step % 50 == 0:
            counts[step] = live_counts()
            over = {name: n for name, n in counts[step].items() if n > bound[name]}
            assert not over, f"at step {step}, more alive than admission allows ({bound}): {over}"
        if step == TRACE_FROM:
            tracemalloc.start()
        elif FIT_FROM <= step < STEPS - 25 and step % 25 == 0:  # not the drain at the end
            traced[step] = sum(t.size for t in tracemalloc.take_snapshot().filter_traces(ignored).traces)

    try:
        summary = await train(config, on_step=on_step)
    finally:
        tracemalloc.stop()
    assert summary.steps == STEPS

    worst = {name: max(c[name] for c in counts.values()) for name in bound}
    print(f"most alive at once: {worst}; bounds {bound}")
    assert worst["Trajectory"] > 0 and worst["ProcessedGroup"] > 0, "nothing was counted: the probe is broken"

    slope = statistics.linear_regression(list(traced), list(traced.values())).slope
    print(f"memory held from the traced steps grows {slope:.0f} B/step ({traced})")
    assert slope < BYTES_PER_STEP, (
        f"memory grows with the steps: {slope:.0f} B/step over steps {min(traced)}-{max(traced)}"
    )
