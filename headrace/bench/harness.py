"""Run a scenario under each scheduler, one after another in one process, and measure each run.

Wall time is the training loop's: from the moment the actors start to the moment the last step
is reported (``time/total`` of the last metrics row), so backend start-up and the final
checkpoint are not in it; the ideal bound (``headrace.bench.ideal``) covers the same window.

Figures per scheduler (the keys of ``results.json``):

``wall_s``, ``ideal_s``, ``efficiency`` (ideal / wall), ``speedup_vs_sync`` (sync wall / wall),
``steps_per_s``, ``trajectories_per_s`` (trajectories trained or filtered, per second),
``tokens_per_s`` (sampled tokens, retried rollouts included, per second), ``learner_busy`` (share
of the wall time the training device was running a call), ``sampler_busy`` (share with at least
one sample request being served), ``sampler_slots`` (sim: request-seconds / (concurrency · wall)),
``staleness_mean`` / ``staleness_max`` (steps between the weights that sampled a group and the
step that trains it), ``sampling_s`` / ``training_s`` (Σ S_k and Σ T_k, see ``ideal``),
``cpu_s`` (process CPU seconds of the whole run, all threads) and ``trajectories_per_cpu_s``,
``final_reward`` (mean reward of the last 10% of steps), ``groups_dropped``, ``rollout_errors``;
with ``overhead``: ``floor_trajectories_per_s`` and ``overhead_ratio`` (engine / floor, wall
clock), and the same per CPU second (``floor_trajectories_per_cpu_s``, ``overhead_ratio_cpu``),
which a busy machine disturbs far less than wall time.

Everything is read from the run's trace (``headrace.core.trace``) and, on ``sim``, from the sim's
own records of the work it modelled, which the trace's sample calls tie to rollouts. On
backends other than ``sim`` there is no latency model, so ``ideal_s`` and ``efficiency`` are
null, and busy times are the traced calls' spans. The same holds on ``--set cluster.kind=ray``
(the sim's records are in the replica and learner processes, out of reach), where ``cpu_s`` and
``trajectories_per_cpu_s`` count the driver's process only, not the workers', replicas' or
learner's.
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from headrace.bench.floor import floor_trajectories_per_s
from headrace.bench.ideal import ideal_bound, inflight_bound, work_from_records
from headrace.bench.scenario import Scenario
from headrace.core.trace import CallCompleted, CallSubmitted, Event, RunStarted
from headrace.run.scheduling import make_scheduler
from headrace.run.train import train

Spans = list[tuple[float, float]]


@dataclass
class RunResult:
    scheduler: str
    figures: dict[str, Any]
    spans: dict[str, Spans] = field(default_factory=dict)  # "sampler" / "learner": busy spans, run-relative seconds
    rewards: list[float] = field(default_factory=list)  # reward/mean per step


def merge(spans: Sequence[tuple[float, float]], lo: float = -math.inf, hi: float = math.inf) -> Spans:
    """The union of ``spans`` clipped to [lo, hi], as sorted disjoint spans."""
    out: Spans = []
    for a, b in sorted(spans):
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered(spans: Spans) -> float:
    return sum(b - a for a, b in spans)


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None and not math.isnan(v)]
    return sum(present) / len(present) if present else None


@dataclass
class TraceRecord:
    """What the bench keeps of a run's trace: busy spans, the sample calls that succeeded (in the
    order the backend finished them) and the backend itself."""

    backend: Any = None
    sampled_tokens: int = 0
    sample_spans: Spans = field(default_factory=list)
    sample_rollouts: list[tuple[int, int, int] | None] = field(default_factory=list)  # ok calls, completion order
    learner_spans: Spans = field(default_factory=list)
    _submitted: dict[tuple[str, int], float] = field(default_factory=dict)
    _device_free: float = -math.inf

    def __call__(self, event: Event) -> None:
        if isinstance(event, CallSubmitted):
            self._submitted[(event.op, event.call)] = event.at
        elif isinstance(event, CallCompleted):
            submitted = self._submitted.pop((event.op, event.call), event.at)
            if event.op == "sample":
                self.sample_spans.append((submitted, event.at))
                if event.ok:
                    self.sampled_tokens += event.tokens
                    self.sample_rollouts.append(event.rollout)
            else:  # training calls run one after another, in submission order
                self.learner_spans.append((max(submitted, self._device_free), event.at))
                self._device_free = event.at
        elif isinstance(event, RunStarted):
            self.backend = event.backend


async def run_one(
    scenario: Scenario, scheduler: str, run_dir: str, overrides: dict[str, Any] | None = None
) -> RunResult:
    """Train the scenario under one scheduler and measure the run."""
    config = scenario.config(scheduler, run_dir, overrides)
    policy = make_scheduler(config)
    loop_offset = _loop_offset()
    started: dict[str, float] = {}
    rows: list[dict[str, Any]] = []  # every step's row (the summary keeps only the last ones)

    def on_step(row: dict[str, Any]) -> None:
        if not started:  # the loop's start, on the perf_counter clock
            started["t0"] = time.perf_counter() - row["time/total"]
        rows.append(row)

    gc.collect()  # the previous run's garbage is not this run's cost
    cpu = time.process_time()
    trace = TraceRecord()
    await train(config, on_step=on_step, tracer=trace)
    cpu = time.process_time() - cpu
    wall = rows[-1]["time/total"]
    t0 = started["t0"]
    backend = trace.backend
    steps = len(rows)
    trajectories = sum(r.get("throughput/trajectories", 0.0) for r in rows)
    tail = rows[-max(1, steps // 10) :]
    figures: dict[str, Any] = {
        "steps": steps,
        "wall_s": wall,
        "ideal_s": None,
        "efficiency": None,
        "speedup_vs_sync": None,
        "steps_per_s": steps / wall,
        "trajectories_per_s": trajectories / wall,
        "tokens_per_s": trace.sampled_tokens / wall,
        "cpu_s": cpu,
        "trajectories_per_cpu_s": trajectories / cpu if cpu > 0 else None,
        "learner_busy": None,
        "sampler_busy": None,
        "sampler_slots": None,
        "staleness_mean": _mean([r.get("staleness/mean", 0.0) for r in rows]),
        "staleness_max": max(r.get("staleness/max", 0.0) for r in rows),
        "sampling_s": None,
        "training_s": None,
        "final_reward": _mean([r.get("reward/mean") for r in tail]),
        "groups_dropped": int(sum(r.get("groups/dropped", 0.0) for r in rows)),
        "rollout_errors": int(rows[-1].get("rollout_errors/total", 0.0)),
        "lag": policy.lag(),
        "minibatches": policy.minibatches(),
    }
    # per phase, where the backend counts FLOPs (torch): the mean over the rows that report them
    for key in PERF_KEYS:
        present = [r[key] for r in rows if key in r]
        if present:
            figures[key.replace("/", "_")] = _mean(present)
    requests = getattr(backend.sampling, "requests", None)
    timeline = getattr(backend.training, "timeline", None)
    if config.backend == "sim" and requests is not None and timeline is not None:
        t0_loop = t0 + loop_offset
        spans = {
            "sampler": merge([(r.start - t0_loop, r.end - t0_loop) for r in requests], 0.0, wall),
            "learner": merge([(s.start - t0_loop, s.end - t0_loop) for s in timeline if s.end > s.start], 0.0, wall),
        }
        limit = getattr(requests, "maxlen", None)  # bounded records: a truncated record has no bound
        truncated = limit is not None and len(requests) >= limit
        # the sim records a request as it returns it: its k-th record is the k-th traced completion
        joined = len(requests) == len(trace.sample_rollouts)
        env_step_s = float(config.env_options.get("tool_s", 0.0))  # a scenario's declared tool latency
        costs = (r.cost for r in requests)
        work = work_from_records(zip(trace.sample_rollouts, costs, strict=False), timeline, env_step_s)
        if not truncated and joined and len(work.steps) == steps:
            sim = config.section("sim")
            cycle = sim.clock_cycle_s
            phase = (-t0_loop) % cycle if cycle > 0 else 0.0
            if policy.admission() == "sample":
                bound = inflight_bound(
                    work, policy.lag(), config.batch_size, sim.sample_concurrency, env_step_s, cycle, phase
                )
            else:
                bound = ideal_bound(work, policy.lag(), policy.minibatches(), sim.sample_concurrency, cycle, phase)
            figures |= {
                "ideal_s": bound.ideal_s,
                "efficiency": bound.ideal_s / wall if bound.ideal_s > 0 else None,  # None: a zero-latency model
                "sampling_s": bound.sampling_s,
                "training_s": bound.training_s,
            }
        figures["sampler_slots"] = sum(r.cost for r in requests) / (config.section("sim").sample_concurrency * wall)
    else:
        spans = {
            "sampler": merge([(a - t0, b - t0) for a, b in trace.sample_spans], 0.0, wall),
            "learner": merge([(a - t0, b - t0) for a, b in trace.learner_spans], 0.0, wall),
        }
    figures["learner_busy"] = covered(spans["learner"]) / wall
    figures["sampler_busy"] = covered(spans["sampler"]) / wall
    rewards = [r.get("reward/mean", float("nan")) for r in rows]
    return RunResult(scheduler, figures, spans, rewards)


PERF_KEYS = (
    "perf/mfu_train",
    "perf/mfu_sample",
    "perf/train_flops_per_s",
    "perf/sample_tokens_per_s",
    "perf/sampler_busy",
    "perf/decode_rows",
)


def _loop_offset() -> float:
    """loop.time() − perf_counter(): the sim records on the loop's clock."""
    return asyncio.get_running_loop().time() - time.perf_counter()


async def measure_floor(
    scenario: Scenario, scheduler: str, overrides: dict[str, Any] | None, repeats: int = 3
) -> tuple[float, float]:
    """The bare-asyncio floor for this scenario's shape under ``scheduler``: trajectories per
    wall second and per CPU second, each the best of ``repeats`` (as the engine's figure is the
    best of its repeats)."""
    config = scenario.config(scheduler, "unused", overrides)
    lag = make_scheduler(config).lag()
    in_flight = config.batch_size * (lag + 1)
    workers = config.rollout_workers or in_flight
    groups = config.steps * config.batch_size
    rates, cpu_rates = [], []
    for _ in range(repeats):
        gc.collect()
        cpu = time.process_time()
        rates.append(await floor_trajectories_per_s(groups, config.group_size, workers, in_flight))
        cpu_rates.append(groups * config.group_size / (time.process_time() - cpu))
    return max(rates), max(cpu_rates)


async def run_scenario(
    scenario: Scenario,
    schedulers: Sequence[str] | None = None,
    overrides: dict[str, Any] | None = None,
    runs_dir: str | Path | None = None,
    on_start: Callable[[str], None] | None = None,
    repeats: int = 1,
) -> list[RunResult]:
    """Each scheduler in turn on the same scenario; run directories go to ``runs_dir`` (kept) or
    to a temporary directory (removed). With ``repeats`` > 1 each scheduler runs that many times
    and keeps its least disturbed run (highest efficiency where there is a bound, else lowest
    wall time): on a shared machine a run can lose seconds to other processes."""
    schedulers = list(schedulers or scenario.schedulers)
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="headrace-bench-") as tmp:
        base = Path(runs_dir) if runs_dir else Path(tmp)
        for scheduler in schedulers:
            if on_start:
                on_start(scheduler)
            floor = await measure_floor(scenario, scheduler, overrides) if scenario.overhead else None
            runs = [await run_one(scenario, scheduler, str(base / scheduler), overrides) for _ in range(repeats)]
            result = min(runs, key=_disturbance)
            result.figures["repeats"] = repeats
            result.figures["wall_s_runs"] = [r.figures["wall_s"] for r in runs]
            if floor is not None:
                f = result.figures
                f["floor_trajectories_per_s"], f["floor_trajectories_per_cpu_s"] = floor
                f["overhead_ratio"] = f["trajectories_per_s"] / f["floor_trajectories_per_s"]
                f["overhead_ratio_cpu"] = f["trajectories_per_cpu_s"] / f["floor_trajectories_per_cpu_s"]
            results.append(result)
    sync = next((r for r in results if r.scheduler == "sync"), None)
    for r in results:
        if sync is not None:
            r.figures["speedup_vs_sync"] = sync.figures["wall_s"] / r.figures["wall_s"]
    return results


def _disturbance(result: RunResult) -> float:
    efficiency = result.figures.get("efficiency")
    return -efficiency if efficiency is not None else result.figures["wall_s"]


def run_scenario_sync(*args: Any, **kwargs: Any) -> list[RunResult]:
    """``run_scenario`` from synchronous code (its own event loop)."""
    return anyio.run(lambda: run_scenario(*args, **kwargs))


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for package in ("headrace", "anyio", "numpy", "torch"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            pass
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
    }
    try:
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    return info
