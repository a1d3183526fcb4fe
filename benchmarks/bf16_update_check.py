"""Does a bfloat16 learner take the float32 learner's steps? One float32 GRPO trajectory, and at
each of its steps the bfloat16 learner's gradient and Adam update from the same weights.

Why: on the Zen 4 host bfloat16 runs of chat arithmetic reached 0.9 reward about 0.75 of a step
later than float32 over eight seeds (benchmarks/RESULTS.md, 2026-12-07), within the seeds' spread.
A learning curve cannot say whether the bfloat16 learner's steps are worse or its runs just drew
other tokens; this compares the steps themselves on the same data. It found the cause: the
LoRA sums were rounded twice in bfloat16, so the bfloat16 policy saw about half of the first
steps (``layers.with_adapter`` now rounds them once).

At each step ``t`` the float32 backend samples the job's batch (8 prompts x 8, 16 tokens) from
its current policy and scores it with the env; the group-normalised advantages make the datums.
The bfloat16 trainer's float32 masters are set to the float32 trainer's weights, both run
``forward_backward`` and ``optim_step`` on the same datums (the run's loss, learning rate and
clipping; the bfloat16 trainer's Adam moments follow its own gradients along the float32 path),
and it prints, per step:

- the gradients' cosine (all LoRA weights as one vector) and norm ratio (bfloat16 / float32);
- the updates' cosine and norm ratio (what Adam did to the weights);
- the first-order gain of the step's objective, ``sum(A * (logp_after - logp_before))`` over the
  action tokens, of each update, both measured with the float32 learner's forward;
- the learners' mean |logprob gap| on the batch before the step;
- how much of the float32 update the bfloat16 learner sees: the slope of its logprob changes on
  the float32 learner's, and its gain over the float32 learner's, for the same change of weights
  (``--round-twice``: with the LoRA sums rounded as before 2026-12-07, about half at step 0).

    python benchmarks/bf16_update_check.py [--steps 8] [--seed 0] [--json out.json] [--round-twice]
    python benchmarks/bf16_update_check.py --initial-rewards 24
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import statistics
from collections.abc import Iterator
from typing import Any

import torch

from headrace.core.advantages import group_advantages
from headrace.core.types import AdamParams, Datum


def _config(dtype: str, seed: int) -> Any:
    from headrace.run.config import build_config
    from headrace.run.defaults import apply_model_defaults

    flags = {"backend": "torch", "model": "smollm2-135m", "env": "arithmetic", "seed": seed}
    flags |= {"batch_size": 8, "group_size": 8, "sampling.max_tokens": 16}
    sets = ["env_options.max_operand=9", "torch.num_threads=1", f"torch.dtype={dtype}", "eval.every=0"]
    return apply_model_defaults(build_config(flags=flags, overrides=sets))


async def sample_group(config: Any, backend: Any, handle: Any, builder: Any, seed: int) -> tuple[list[int], list, list]:
    """One group of the env sampled from ``handle``'s weights and scored: (prompt, samples, rewards)."""
    envs = await builder.make_envs()
    prompt, stop = await envs[0].initial_observation()
    params = dataclasses.replace(
        config.sampling.params(), max_tokens=stop.max_tokens, stop_token_ids=stop.stop_token_ids, seed=seed
    )
    samples = await backend.sampling.sample(handle, list(prompt), len(envs), params)
    rewards = []
    for env, x in zip(envs, samples, strict=True):
        await env.initial_observation()
        rewards.append((await env.step(x)).reward)
    return list(prompt), samples, rewards


async def _sample_batch(config: Any, backend: Any, handle: Any, dataset: Any, step: int) -> list[tuple]:
    """Every group of the dataset's batch ``step``, sampled together: [(prompt, samples, rewards)]."""
    async with asyncio.TaskGroup() as tg:
        tasks = [
            tg.create_task(sample_group(config, backend, handle, b, step * 1000 + i))
            for i, b in enumerate(dataset.get_batch(step))
        ]
    return [t.result() for t in tasks]


async def _batch(config: Any, backend: Any, handle: Any, dataset: Any, step: int) -> tuple[list[Datum], dict]:
    """The step's datums: every group of the dataset's batch sampled from the current policy, those
    whose rewards all agree dropped (the run's advantage actor skips them too)."""
    datums: list[Datum] = []
    rewards_all: list[float] = []
    for prompt, samples, rewards in await _sample_batch(config, backend, handle, dataset, step):
        rewards_all.extend(rewards)
        if max(rewards) == min(rewards):
            continue
        n = len(prompt) - 1
        for x, adv in zip(samples, group_advantages(rewards, normalize_std=True), strict=True):
            if x.tokens:
                seq, k = prompt + list(x.tokens), len(x.tokens)
                datums.append(
                    Datum(seq[:-1], seq[1:], [0.0] * n + list(x.logprobs), [0.0] * n + [adv] * k, [0.0] * n + [1.0] * k)
                )
    return datums, {"reward": sum(rewards_all) / len(rewards_all), "datums": float(len(datums))}


def _vector(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[n].detach().float().flatten() for n in sorted(tensors)])


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-30))


def _actions(datums: list[Datum], *logprobs: list[list[float]]) -> Iterator[tuple[float, ...]]:
    """(advantage, each of ``logprobs``' values) at every action token of ``datums``."""
    for d, *rows in zip(datums, *logprobs, strict=True):
        for adv, m, *values in zip(d.advantages, d.mask, *rows, strict=True):
            if m:
                yield adv, *values


def _slope(datums: list[Datum], b32: list[list[float]], a32: list[list[float]], b16, a16) -> float:
    """The least-squares slope of the bfloat16 learner's logprob changes on the float32 one's,
    over the action tokens, for the same change of weights: 1 when bfloat16 sees the whole step."""
    sxy = sxx = 0.0
    for _, x0, x1, y0, y1 in _actions(datums, b32, a32, b16, a16):
        sxy += (x1 - x0) * (y1 - y0)
        sxx += (x1 - x0) ** 2
    return sxy / sxx if sxx else math.nan


def _set_masters(trainer: Any, weights: dict[str, torch.Tensor]) -> None:
    """A bfloat16 trainer's float32 masters set to ``weights``, and its model's copy from them."""
    with torch.no_grad():
        for n, m in trainer._masters.items():
            m.copy_(weights[n])
    trainer._refresh_from_masters()


def _set_params(trainer: Any, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in trainer.params.items():
            p.copy_(weights[n])


def round_twice() -> None:
    """The arithmetic before 2026-12-07: the base's product rounded, then its sum with the
    adapter's (the learner's layers only; the sampler here is the float32 backend's)."""
    from headrace.backends.torch import layers, lora

    def twice(base: Any, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
        return layers.linear(base, x).addmm_(a, b.t(), alpha=scaling)

    layers.with_adapter = lora.with_adapter = twice


def _gain(datums: list[Datum], before: list[list[float]], after: list[list[float]]) -> float:
    """sum over action tokens of advantage * (logp_after - logp_before)."""
    return sum(adv * (a - b) for adv, b, a in _actions(datums, before, after))


async def check(steps: int, seed: int) -> list[dict[str, float]]:
    from headrace.run.backends import make_backend
    from headrace.run.train import make_dataset

    c32, c16 = _config("float32", seed), _config("bfloat16", seed)
    adam = AdamParams(**c32.optim.model_dump())
    loss = c32.loss.spec(c32.sampling.max_tokens)
    rows = []
    async with make_backend(c32) as b32, make_backend(c16) as b16:
        t32, t16 = b32.training, b16.training
        assert not t32._masters and set(t16._masters) == set(t32.params), "LoRA weights of the same names"
        dataset = make_dataset(c32, b32)
        handle = b32.initial_handle()
        for step in range(steps):
            datums, info = await _batch(c32, b32, handle, dataset, step)
            if not datums:
                rows.append({"step": step, **info})
                continue
            before = {n: p.detach().clone() for n, p in t32.params.items()}
            _set_masters(t16, before)
            r32 = await t32.forward_backward(datums, loss)
            g32 = _vector({n: p.grad for n, p in t32.params.items() if p.grad is not None})
            r16 = await t16.forward_backward(datums, loss)
            g16 = _vector({n: p.grad for n, p in t16.params.items() if p.grad is not None})
            await t16.optim_step(adam)
            await t32.optim_step(adam)
            handle = await t32.publish(step + 1)
            after32 = {n: p.detach().clone() for n, p in t32.params.items()}
            u32 = _vector({n: after32[n] - before[n] for n in before})
            u16 = _vector({n: t16._masters[n].detach() - before[n] for n in before})
            lp_after32 = await t32.forward(datums)
            _set_params(t32, t16._masters)  # the bfloat16 update, measured by the float32 learner
            lp_after16 = await t32.forward(datums)
            _set_params(t32, after32)
            gaps = [abs(a - b) for _, a, b in _actions(datums, r32.logprobs_D, r16.logprobs_D)]
            _set_masters(t16, after32)  # the float32 update, measured by the bfloat16 learner
            lp16_after32 = await t16.forward(datums)
            gain32, gain16 = _gain(datums, r32.logprobs_D, lp_after32), _gain(datums, r32.logprobs_D, lp_after16)
            seen = _gain(datums, r16.logprobs_D, lp16_after32)
            row = {
                "step": step,
                **info,
                "grad_cos": _cos(g32, g16),
                "grad_norm_ratio": float(g16.norm() / g32.norm()),
                "update_cos": _cos(u32, u16),
                "update_norm_ratio": float(u16.norm() / u32.norm()),
                "gain32": gain32,
                "gain16": gain16,
                "gain_ratio": gain16 / gain32 if gain32 else math.nan,
                "mean_gap": sum(gaps) / len(gaps),
                "seen_slope": _slope(datums, r32.logprobs_D, lp_after32, r16.logprobs_D, lp16_after32),
                "seen_gain_ratio": seen / gain32 if gain32 else math.nan,
            }
            rows.append(row)
            print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return rows


async def initial_rewards(batches: int, seed: int) -> dict[str, list[float]]:
    """Each dtype's untrained policy on the same ``batches`` batches, its mean reward per group
    (printed with its standard error, and the two paired): is the bfloat16 model the float32 one,
    before any learning?"""
    from headrace.run.backends import make_backend
    from headrace.run.train import make_dataset

    out = {}
    for dtype in ("float32", "bfloat16"):
        config = _config(dtype, seed)
        async with make_backend(config) as backend:
            dataset = make_dataset(config, backend)
            handle, groups = backend.initial_handle(), []
            for b in range(batches):
                groups += [statistics.mean(r) for _, _, r in await _sample_batch(config, backend, handle, dataset, b)]
        out[dtype] = groups
        print(dtype, _mean_se(groups), flush=True)
    diffs = [b - a for a, b in zip(out["float32"], out["bfloat16"], strict=True)]
    print("bfloat16 - float32, paired by group:", _mean_se(diffs), flush=True)
    return out


def _mean_se(xs: list[float]) -> dict[str, float]:
    se = statistics.stdev(xs) / math.sqrt(len(xs))
    return {"mean": round(statistics.mean(xs), 4), "se": round(se, 4), "groups": len(xs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument(
        "--initial-rewards",
        type=int,
        default=0,
        metavar="BATCHES",
        help="instead: each dtype's untrained policy's mean reward over BATCHES batches",
    )
    p.add_argument("--round-twice", action="store_true", help="the bfloat16 LoRA sums as before 2026-12-07")
    args = p.parse_args()
    if args.round_twice:
        round_twice()
    if args.initial_rewards:
        asyncio.run(initial_rewards(args.initial_rewards, args.seed))
        return
    rows = asyncio.run(check(args.steps, args.seed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
