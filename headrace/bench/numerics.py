"""``headrace check numerics``: do the sampler and the learner compute the same distribution?

Like the Tinker cookbook's ``rl_numerics_check``: sample ``--episodes`` completions of the env's
first prompts with the run's backend, recompute every sampled token's logprob in the learner
(``forward_backward`` with zero advantages: the learner's own path, nothing is applied), and
print the mean KL(sampler || learner) per token by position bucket, as the k1 estimate
(``log p_s - log p_l``: unbiased, can be negative) and the k3 one (``r - 1 - log r`` with ``r =
p_l / p_s``: never negative), and the largest per-token gap ``|log p_s - log p_l|``.

    headrace check numerics --model smollm2-135m [--set torch.dtype=bfloat16] [--episodes 64]
    headrace check numerics --run-dir runs/NAME   # a run's latest checkpoint: its trained weights

A check on untrained LoRA adapters (``B`` = 0) cannot see an error in how the adapters'
products enter the model; ``--run-dir`` samples from a run's trained weights, with its options.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headrace.core.types import Datum, LossSpec

BUCKETS = ((0, 4), (4, 8), (8, 16), (16, 32), (32, 64), (64, 10**9))


@dataclass
class NumericsReport:
    dtype: str
    episodes: int
    tokens: int
    k1: float  # mean over tokens
    k3: float
    max_gap: float
    buckets: list[dict[str, Any]] = field(default_factory=list)  # per position bucket: range, tokens, k1, k3, max_gap
    checkpoint: str | None = None  # the weights sampled: a run's checkpoint, or None for the untrained model

    def lines(self) -> list[str]:
        out = [
            f"{self.episodes} episodes, {self.tokens} sampled tokens, {self.dtype}: mean KL(sampler || learner) "
            f"k1 {self.k1:.3g}, k3 {self.k3:.3g}; largest per-token |logprob gap| {self.max_gap:.3g}",
            f"{'positions':>10} {'tokens':>7} {'k1':>10} {'k3':>10} {'max gap':>10}",
        ]
        for b in self.buckets:
            out.append(f"{b['positions']:>10} {b['tokens']:>7} {b['k1']:>10.3g} {b['k3']:>10.3g} {b['max_gap']:>10.3g}")
        if self.checkpoint is not None:
            out.insert(0, f"weights: {self.checkpoint}")
        return out


def compare(sampled: Sequence[Sequence[float]], learned: Sequence[Sequence[float]], dtype: str) -> NumericsReport:
    """Per-token sampler and learner logprobs of the same tokens, episode by episode."""
    sums: dict[int, list[float]] = {i: [0, 0.0, 0.0, 0.0] for i in range(len(BUCKETS))}
    for s_row, l_row in zip(sampled, learned, strict=True):
        for pos, (s, lp) in enumerate(zip(s_row, l_row, strict=True)):
            i = next(k for k, (lo, hi) in enumerate(BUCKETS) if lo <= pos < hi)
            log_r = lp - s
            acc = sums[i]
            acc[0] += 1
            acc[1] += -log_r
            acc[2] += math.expm1(log_r) - log_r
            acc[3] = max(acc[3], abs(log_r))
    buckets = [
        {
            "positions": f"{lo}-{hi - 1}" if hi < 10**9 else f"{lo}+",
            "tokens": int(a[0]),
            "k1": a[1] / a[0],
            "k3": a[2] / a[0],
            "max_gap": a[3],
        }
        for (lo, hi), a in ((BUCKETS[i], sums[i]) for i in sums)
        if a[0]
    ]
    n = sum(a[0] for a in sums.values())
    return NumericsReport(
        dtype=dtype,
        episodes=len(sampled),
        tokens=int(n),
        k1=sum(a[1] for a in sums.values()) / max(n, 1),
        k3=sum(a[2] for a in sums.values()) / max(n, 1),
        max_gap=max((a[3] for a in sums.values()), default=0.0),
        buckets=buckets,
    )


async def check_numerics(config, episodes: int, group_size: int = 8, checkpoint: str | None = None) -> NumericsReport:
    """Sample ``episodes`` completions (``group_size`` per prompt) of the run's env with its
    backend, from ``checkpoint``'s weights where one is given, and compare the sampler's
    logprobs with the learner's."""
    from headrace.run.backends import make_backend
    from headrace.run.defaults import apply_model_defaults
    from headrace.run.train import make_dataset

    config = apply_model_defaults(config)
    async with make_backend(config) as backend:
        dataset = make_dataset(config, backend)
        prompts: list[tuple[list[int], Any]] = []
        batch = 0
        while len(prompts) * group_size < episodes:
            for builder in dataset.get_batch(batch):
                envs = await builder.make_envs()
                prompt, stop = await envs[0].initial_observation()
                prompts.append((list(prompt), stop))
                if len(prompts) * group_size >= episodes:
                    break
            batch += 1
        handle = backend.initial_handle()
        if checkpoint is not None:
            await backend.training.load_state(checkpoint)
            handle = await backend.training.publish(1)
        s = config.sampling

        async def group(i: int, prompt: list[int], stop) -> list[tuple[list[int], Any]]:
            params = dataclasses.replace(
                s.params(), max_tokens=stop.max_tokens, stop_token_ids=stop.stop_token_ids, seed=config.seed * 1000 + i
            )
            return [(prompt, x) for x in await backend.sampling.sample(handle, prompt, group_size, params)]

        groups = await asyncio.gather(*[group(i, p, st) for i, (p, st) in enumerate(prompts)])
        pairs = [pair for g in groups for pair in g][:episodes]
        datums, sampled = [], []
        for prompt, x in pairs:
            if len(x.tokens) < 1:
                continue
            seq = prompt + list(x.tokens)
            n = len(prompt) - 1
            mask = [0.0] * n + [1.0] * len(x.tokens)
            datums.append(Datum(seq[:-1], seq[1:], [0.0] * n + list(x.logprobs), [0.0] * len(mask), mask))
            sampled.append(list(x.logprobs))
        result = await backend.training.forward_backward(datums, LossSpec("importance_sampling"))
        learned = [lps[len(lps) - len(s_row) :] for lps, s_row in zip(result.logprobs_D, sampled, strict=True)]
        dtype = str(backend.describe().get("dtype", "?"))
    return dataclasses.replace(compare(sampled, learned, dtype), checkpoint=checkpoint)


def setup(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[1] if __doc__ else None
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="check", required=True, metavar="CHECK")
    p = sub.add_parser("numerics", help="the sampler's logprobs against the learner's: KL by position, largest gap")
    p.add_argument("--model", default=None, help="the model (default: the run default, tiny)")
    p.add_argument("--backend", default=None, help="default: the run's (--run-dir), else torch")
    p.add_argument(
        "--run-dir",
        default=None,
        help="sample a run's latest checkpoint (its trained weights), with the options the run was started with",
    )
    p.add_argument("--env", default=None, help="whose prompts (default: the run default, arithmetic)")
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any run option")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_numerics)


def _run_checkpoint(path: Path) -> tuple[dict[str, Any], str]:
    """A run directory's saved options (no run directory of the check's own) and its latest
    checkpoint."""
    from headrace.core.errors import ConfigError
    from headrace.run.rundir import RunDir

    saved = RunDir.saved_options(path)
    if saved is None:
        raise ConfigError(
            f"--run-dir '{path}' holds no run (no config.json there). Pass the directory a `headrace run` wrote "
            "(its --run-dir), or leave --run-dir out to check the untrained model."
        )
    latest = RunDir(path).latest_checkpoint()
    if latest is None:
        raise ConfigError(
            f"--run-dir '{path}' has no checkpoint yet: nothing trained there to check. Let the run save one "
            "(it saves at its end, or every --save-every steps), or leave --run-dir out to check the untrained model."
        )
    return {**saved, "resume": False, "teacher": None}, latest["path"]


def cmd_numerics(args: argparse.Namespace) -> int:
    from headrace.run.config import build_config

    base, checkpoint = _run_checkpoint(Path(args.run_dir)) if args.run_dir else (None, None)
    backend = args.backend or (None if base else "torch")
    flags = {"backend": backend, "seed": args.seed, "model": args.model, "env": args.env}
    flags["sampling.max_tokens"] = args.max_tokens
    config = build_config(flags=flags, overrides=args.set, base=base)
    report = asyncio.run(check_numerics(config, args.episodes, args.group_size, checkpoint))
    if args.json:
        print(json.dumps(report.__dict__, indent=1))
    else:
        print("\n".join(report.lines()))
    return 0
