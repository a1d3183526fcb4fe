"""Time per training step of the torch learner, pipelined vs not, measured in one run.

Each step the learner prepares its data on the Python side (trajectories → group advantages →
datums, with the engine's own functions, plus ``--extra-prep-ms`` of CPU-bound Python work
standing in for reward code or tokenisation), then submits ``forward_backward`` +
``optim_step`` + ``publish``.

- **pipelined**: step k's calls are submitted, then step k+1's data is prepared while the
  device thread computes step k, then step k's futures are awaited.
- **serial**: every future is awaited before the next call is submitted, and the next step's
  data is prepared only after that.

The two modes alternate in blocks within one process, so background load hits both alike.
Prints a table and one JSON line; the ratio is serial time / pipelined time per step (> 1:
pipelining helps). Ideal ratio: (prep + device) / max(prep, device).

    python benchmarks/pipelining_torch.py
    python benchmarks/pipelining_torch.py --extra-prep-ms 100 --steps 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from headrace.core.advantages import group_advantages
from headrace.core.datums import trajectory_to_datums
from headrace.core.types import AdamParams, LossSpec, SamplingParams, StopReason, Trajectory, Transition
from headrace.run.backends import make_backend
from headrace.run.config import RunConfig


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    x = 0
    while time.perf_counter() < end:
        x += 1


def prepare(groups, extra_prep_ms: float):
    """The learner-side Python work of one step: rewards → advantages → datums."""
    busy(extra_prep_ms)
    datums = []
    for prompt, samples, rewards in groups:
        for sample, adv in zip(samples, group_advantages(rewards, normalize_std=True), strict=True):
            traj = Trajectory([Transition(prompt, sample, 0.0, True)], StopReason.DONE)
            datums += trajectory_to_datums(traj, adv)
    return datums


async def main(args: argparse.Namespace) -> dict:
    config = RunConfig(seed=args.seed)
    async with make_backend(config) as backend:
        tok, handle = backend.tokenizer, backend.initial_handle()
        prompts = [tok.encode(f"{a % 5}+{a // 5 % 5}=") for a in range(args.batch_size)]
        params = SamplingParams(max_tokens=args.max_tokens)
        sampled = await asyncio.gather(*[backend.sampling.sample(handle, p, args.group_size, params) for p in prompts])
        groups = [(p, s, [float(i % 2) for i in range(len(s))]) for p, s in zip(prompts, sampled, strict=True)]
        loss, adam = LossSpec("importance_sampling"), AdamParams(learning_rate=1e-5)
        tr = backend.training
        version = 0

        async def pipelined(steps: int) -> float:
            nonlocal version
            start = time.perf_counter()
            datums = prepare(groups, args.extra_prep_ms)
            for _ in range(steps):
                version += 1
                futures = [tr.forward_backward(datums, loss), tr.optim_step(adam), tr.publish(version)]
                datums = prepare(groups, args.extra_prep_ms)  # overlaps the device's work
                await asyncio.gather(*futures)
            return (time.perf_counter() - start) / steps

        async def serial(steps: int) -> float:
            nonlocal version
            start = time.perf_counter()
            for _ in range(steps):
                version += 1
                datums = prepare(groups, args.extra_prep_ms)
                await tr.forward_backward(datums, loss)
                await tr.optim_step(adam)
                await tr.publish(version)
            return (time.perf_counter() - start) / steps

        await serial(2)  # warm-up
        t0 = time.perf_counter()
        prepare(groups, args.extra_prep_ms)
        prep_s = time.perf_counter() - t0
        times: dict[str, list[float]] = {"pipelined": [], "serial": []}
        for _ in range(args.rounds):
            times["serial"].append(await serial(args.steps))
            times["pipelined"].append(await pipelined(args.steps))
        facts = backend.describe()
    result = {
        "benchmark": "pipelining_torch",
        "model": facts["model"],
        "params": facts["total_params"],
        "device": facts["device"],
        "torch_threads": facts["torch_threads"],
        "datums_per_step": args.batch_size * args.group_size,
        "prep_ms": prep_s * 1000,
        "serial_step_ms": statistics.median(times["serial"]) * 1000,
        "pipelined_step_ms": statistics.median(times["pipelined"]) * 1000,
    }
    result["ratio_serial_over_pipelined"] = result["serial_step_ms"] / result["pipelined_step_ms"]
    device_ms = result["serial_step_ms"] - result["prep_ms"]
    result["ideal_ratio"] = result["serial_step_ms"] / max(result["prep_ms"], device_ms)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=32, help="groups per step")
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--extra-prep-ms", type=float, default=0.0, help="CPU-bound Python work added to each step's prep")
    ap.add_argument("--steps", type=int, default=5, help="steps per block")
    ap.add_argument("--rounds", type=int, default=4, help="blocks per mode, alternating")
    ap.add_argument("--seed", type=int, default=0)
    res = asyncio.run(main(ap.parse_args()))
    for key in ("prep_ms", "serial_step_ms", "pipelined_step_ms", "ratio_serial_over_pipelined", "ideal_ratio"):
        print(f"{key:>28}: {res[key]:.3f}")
    print(json.dumps(res))
