"""Cycles per step on a Tinker-like service: headrace's schedulers and the Tinker cookbook's own
loop against the local emulator, lock-step clock cycles with hard boundaries.

    python benchmarks/tinker_clock.py                       # ½- and 1-cycle sampling, 3 runs each
    python benchmarks/tinker_clock.py --latencies 0.5 --loops stream --repeats 1 --steps 20

The emulator (``headrace tinker-emulator``) runs in a process of its own, a fresh one per run;
every run goes through the official SDK over loopback HTTP (the cookbook's loop from a child
process). It computes with the embedded tiny model (``--compute torch``, real training), whose
compute adds to the sampling latency asked for: the "sample" column says what a sample took.
``--compute bigram`` (the emulator's bigram model, no torch) computes less.

Every figure but seconds/step comes from the emulator's request records:

- cycles/step: grid cycles from the first step's ``optim_step`` to the last one's, per step;
- split: steps whose ``forward_backward``s and ``optim_step`` ran in more than one cycle; of
  those, "ready" counts the ones whose data was all in (the learner had submitted the step's
  ``optim_step``) before the boundary that its ``optim_step`` missed, with how long before, in ms;
- sample: a sample request's time on the server, in cycles (the latency asked for, plus compute);
- pub late: steps whose new weights went to the sampler (``save_weights_for_sampler``) a cycle
  after their ``optim_step``.

Seconds/step: the steady state at the client (between the first and the last step's end).
Appends a JSON line per run to ``--out`` (default: benchmarks/out/tinker_clock.jsonl).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("TINKER_TELEMETRY", "0")

TRAINING_OPS = ("forward_backward", "optim_step", "save_weights_for_sampler")
HEADRACE = ("sync", "stream", "async")
COOKBOOK = ("cookbook-sync", "cookbook-async")


def cycle_figures(
    records: list[dict[str, Any]],
    steps: int,
    cycle_s: float,
    model_id: str | None = None,
    ready_at: list[float] | None = None,
) -> dict[str, Any]:
    """One training model's step figures from the emulator's request records (the model with
    the most ``optim_step``s when ``model_id`` is None). ``ready_at``: per step, the wall time its
    data was all in. Cycles and splits are counted as ``benchmarks/cookbook_loop.py`` counts them.

    The grid cycle of an op is its record's ``grid_cycle``; an emulator without that field is
    read from when each cycle started (its ``cycle`` numbers only the cycles that ran work)."""
    ops = [r for r in records if r.get("event") == "op" and r.get("cycle") is not None and r.get("start_t")]
    if not ops:
        raise ValueError("the records hold no training op that ran on the clock")
    if all(r.get("grid_cycle") is not None for r in ops):
        t0 = min(r["start_t"] - r["grid_cycle"] * cycle_s for r in ops)  # the grid's origin, wall time

        def grid(r: dict[str, Any]) -> int:
            return int(r["grid_cycle"])
    else:
        started: dict[int, float] = {}
        for r in ops:
            started[r["cycle"]] = min(started.get(r["cycle"], r["start_t"]), r["start_t"])
        t0 = min(started.values())

        def grid(r: dict[str, Any]) -> int:
            return round((started[r["cycle"]] - t0) / cycle_s)

    training = [r for r in ops if r.get("op") in TRAINING_OPS]
    if model_id is None:
        optims: dict[str, int] = defaultdict(int)
        for r in training:
            optims[r["model_id"]] += r["op"] == "optim_step"
        model_id = max(optims, key=optims.__getitem__)
    per_step: list[dict[str, Any]] = []
    fbs: list[dict[str, Any]] = []
    for r in sorted((r for r in training if r["model_id"] == model_id), key=lambda r: r["seq_id"]):
        if r["op"] == "forward_backward":
            fbs.append(r)
        elif r["op"] == "optim_step":
            per_step.append({"fbs": fbs, "optim": r, "publish": None})
            fbs = []
        elif per_step and per_step[-1]["publish"] is None:
            per_step[-1]["publish"] = r
    if len(per_step) != steps:
        raise ValueError(f"the records hold {len(per_step)} optim_steps of {model_id}, not the run's {steps} steps")
    split, ready_ms, late_publish = [], [], 0
    for i, s in enumerate(per_step):
        first, last = min(grid(r) for r in [*s["fbs"], s["optim"]]), grid(s["optim"])
        if last > first:
            split.append(i)
            missed = t0 + (last - 1) * cycle_s  # the boundary the optim_step missed
            if ready_at is not None and ready_at[i] < missed:
                ready_ms.append(round((missed - ready_at[i]) * 1000))
        if s["publish"] is not None and grid(s["publish"]) > last:
            late_publish += 1
    optim_grid = [grid(s["optim"]) for s in per_step]
    samples = [r["complete_t"] - r["submit_t"] for r in records if r.get("op") == "sample" and r.get("complete_t")]
    return {
        "model_id": model_id,
        "sample_cycles": round(sum(samples) / len(samples) / cycle_s, 2) if samples else None,  # as measured
        "cycles_per_step": round((optim_grid[-1] - optim_grid[0]) / (steps - 1), 3) if steps > 1 else None,
        "split": len(split),
        "split_steps": split,
        "split_ready_ms": ready_ms if ready_at is not None else None,  # per split step whose data was in
        "publish_late": late_publish,
        "fb_requests": [len(s["fbs"]) for s in per_step],
        "optim_cycles": optim_grid,
    }


class _Trace:
    """The bench's tracer: the backend (for its model id) and when each step's data was all in."""

    def __init__(self) -> None:
        self.backend: Any = None
        self.ready_at: list[float] = []  # wall time of each optim_step the learner submitted
        self._offset = time.time() - time.perf_counter()

    def __call__(self, event: Any) -> None:
        from headrace.core.trace import CallSubmitted, RunStarted

        if isinstance(event, RunStarted):
            self.backend = event.backend
        elif isinstance(event, CallSubmitted) and event.op == "optim_step":
            self.ready_at.append(event.at + self._offset)


class _Emulator:
    """``headrace tinker-emulator`` in a process of its own, as a user runs it: the client under
    test never shares an interpreter (and its GIL) with the server."""

    def __init__(self, args: argparse.Namespace, latency_s: float):
        self.argv = [
            *(sys.executable, "-m", "headrace", "tinker-emulator", "--port", "0", "--compute", args.compute),
            *("--clock-cycle-s", str(args.clock_cycle_s), "--sample-latency-s", str(latency_s)),
            *("--follow-s", str(args.follow_s)),
            *(("--max-ops-per-cycle", str(args.max_ops_per_cycle)) if args.max_ops_per_cycle else ()),
        ]
        self.url = ""
        self._out = tempfile.NamedTemporaryFile("w+", prefix="tinker-clock-emulator-", suffix=".log")  # noqa: SIM115

    def __enter__(self) -> _Emulator:
        env = os.environ | {"TINKER_TELEMETRY": "0"}
        self._proc = subprocess.Popen(self.argv, stdout=self._out, stderr=subprocess.STDOUT, env=env)  # noqa: S603
        deadline = time.monotonic() + 120
        while not self.url:
            lines = Path(self._out.name).read_text().splitlines()
            self.url = next((line.split()[3] for line in lines if line.startswith("Tinker emulator on ")), "")
            if not self.url and (self._proc.poll() is not None or time.monotonic() > deadline):
                self.__exit__()
                raise RuntimeError(f"the emulator did not start: {Path(self._out.name).read_text()[-3000:]}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._out.close()

    def log(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/emulator/log", timeout=60) as r:  # noqa: S310 - loopback
            return json.loads(r.read())["records"]


async def _headrace(url: str, scheduler: str, args: argparse.Namespace, trace: _Trace) -> float:
    from headrace.run.config import build_config
    from headrace.run.train import train

    flags = dict(
        backend="tinker",
        scheduler=scheduler,
        steps=args.steps,
        batch_size=args.groups,
        group_size=args.group_size,
        num_minibatches=args.minibatches,
        run_dir=tempfile.mkdtemp(prefix="tinker-clock-"),
        progress=False,
        max_steps_off_policy=args.max_steps_off_policy,
    )
    overrides = [
        f"tinker.base_url={url}",
        "advantages.filter_constant=false",  # every group trains: every step applies an update
        "tinker.commit_every=0",
        f"sampling.max_tokens={args.max_tokens}",
        *(f"tinker.{kv}" for kv in args.tinker),
    ]
    summary = await train(build_config(flags=flags, overrides=overrides), tracer=trace)
    ends = [r["time/total"] for r in summary.metrics]  # seconds since the start, at each step's end
    return (ends[-1] - ends[0]) / max(len(ends) - 1, 1)  # steady state: the first step pays for start-up


def headrace_row(args: argparse.Namespace, scheduler: str, latency_s: float) -> dict[str, Any]:
    trace = _Trace()
    with _Emulator(args, latency_s) as emu:  # a fresh server per run
        step_s = asyncio.run(_headrace(emu.url, scheduler, args, trace))
        records = emu.log()
    model = trace.backend.training.client.model_id
    figures = cycle_figures(records, args.steps, args.clock_cycle_s, model, trace.ready_at)
    _same_count(records, args.steps, model, figures)
    return {"loop": f"headrace {scheduler}", "s_per_step": round(step_s, 3), **figures}


def _cookbook_loop() -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import cookbook_loop  # benchmarks/cookbook_loop.py

        return cookbook_loop
    finally:
        sys.path.pop(0)


def _same_count(records: list[dict[str, Any]], steps: int, model: str, figures: dict[str, Any]) -> None:
    """headrace's rows and the cookbook's are counted the same way: check it, where both exist."""
    try:
        theirs = _cookbook_loop().cycle_figures(records, steps, model_id=model)
    except ImportError:
        return
    mine = (figures["cycles_per_step"], figures["split"])
    if (theirs["cycles_per_step"], theirs["split_steps"]) != mine:
        raise AssertionError(f"cookbook_loop.cycle_figures counts {theirs} where this bench counts {mine}")


def cookbook_row(args: argparse.Namespace, mode: str, latency_s: float) -> dict[str, Any]:
    """The Tinker cookbook's own ``rl.train`` loop (``benchmarks/cookbook_loop.py``) on the same
    emulator settings, with the embedded model's tokenizer registered for its model name."""
    loop = _cookbook_loop()
    with _Emulator(args, latency_s) as emu:
        row = loop.run_cookbook(
            emu.url,
            mode=mode,
            steps=args.steps,
            groups=args.groups,
            group_size=args.group_size,
            max_tokens=args.max_tokens,
            max_steps_off_policy=args.max_steps_off_policy,
            tokenizer="tiny",
        )
        records = emu.log()
    figures = cycle_figures(records, args.steps, args.clock_cycle_s, row["model_id"])
    return {"loop": f"cookbook {mode}", "s_per_step": row["mean_step_s"], **figures}


def run_one(args: argparse.Namespace, loop: str, latency_s: float) -> dict[str, Any]:
    if loop in COOKBOOK:
        return cookbook_row(args, loop.removeprefix("cookbook-"), latency_s)
    return headrace_row(args, loop, latency_s)


def _span(values: list[Any]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clock-cycle-s", type=float, default=0.5)
    parser.add_argument("--latencies", default="0.5,1", help="sampling latency per request, in cycles")
    parser.add_argument("--follow-s", type=float, default=0.0, help="the emulator's follow window; 0: hard boundaries")
    parser.add_argument(
        "--max-ops-per-cycle", type=int, default=0, help="the emulator's cap on a model's compute ops per cycle"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--groups", type=int, default=4, help="groups per step (batch size)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--minibatches", type=int, default=4, help="stream: forward_backward calls per step")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-steps-off-policy", type=int, default=1)
    parser.add_argument("--loops", default=",".join(HEADRACE + COOKBOOK), help=f"of {', '.join(HEADRACE + COOKBOOK)}")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each loop at each latency")
    parser.add_argument("--tinker", action="append", default=[], help="a headrace tinker.KEY=VALUE setting")
    parser.add_argument("--compute", default="torch", choices=["torch", "bigram"])
    parser.add_argument("--out", default="benchmarks/out/tinker_clock.jsonl")
    args = parser.parse_args()
    loops = args.loops.split(",")
    unknown = sorted(set(loops) - set(HEADRACE + COOKBOOK))
    if unknown:
        parser.error(f"unknown loop(s) {unknown}; pick from {', '.join(HEADRACE + COOKBOOK)}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table: dict[tuple[float, str], list[dict[str, Any]]] = defaultdict(list)
    for cycles in (float(x) for x in args.latencies.split(",")):
        for _ in range(args.repeats):
            for loop in loops:
                try:
                    row = run_one(args, loop, cycles * args.clock_cycle_s)
                except Exception as e:  # noqa: BLE001 - one loop failing leaves the others' rows
                    print(f"{loop} at {cycles:g} cycles failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    continue
                row |= {
                    "latency_cycles": cycles,
                    "clock_cycle_s": args.clock_cycle_s,
                    "follow_s": args.follow_s,
                    "max_ops_per_cycle": args.max_ops_per_cycle,
                    "compute": args.compute,
                    "tinker": args.tinker,
                }
                print(
                    json.dumps({k: v for k, v in row.items() if k not in ("optim_cycles", "fb_requests")}), flush=True
                )
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                table[cycles, row["loop"]].append(row)
    print(
        f"\n{args.groups} groups x {args.group_size}, {args.max_tokens} tokens, {args.steps} steps, "
        f"{args.clock_cycle_s} s cycle, follow_s {args.follow_s}, max ops/cycle {args.max_ops_per_cycle or '-'}, "
        f"{args.compute} compute, {args.repeats} run(s) each {' '.join(args.tinker)}"
    )
    print(
        f"{'sampling':<9}{'loop':<18}{'sample':>10}{'cycles/step':>12}{'s/step':>13}{'split':>8}  "
        f"{'ready (ms before)':<18}{'pub late':>8}"
    )
    for (cycles, loop), rows in table.items():
        ready = [ms for r in rows for ms in (r["split_ready_ms"] or [])]
        print(
            f"{cycles:<9g}{loop:<18}{_span([r['sample_cycles'] for r in rows]):>10}"
            f"{_span([r['cycles_per_step'] for r in rows]):>12}"
            f"{_span([r['s_per_step'] for r in rows]):>13}{'/'.join(str(r['split']) for r in rows):>8}  "
            f"{(f'{len(ready)} {ready}' if ready else '0'):<18}{'/'.join(str(r['publish_late']) for r in rows):>8}"
        )


if __name__ == "__main__":
    main()
