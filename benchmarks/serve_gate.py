"""The serve gate's error rates, measured: its false-accept rate with a candidate no better than
the incumbent, and its power against a candidate known to be better.

The incumbent and the better candidate are two checkpoints of one `headrace run` on the gate's
own task (the tiny model on arithmetic: say step 20, ~0.15 reward, and step 60, ~0.65), loaded
into one torch backend. Each trial draws its own held-out problems (``EnvGate(seed=trial)``) and
asks the gate (``serve.gate_improve``, the real ``EnvGate`` and sampler) three questions:

- *identical*: a fork of the incumbent with the same weights, on the same problems and seeds;
- *null*: the incumbent again on other seeds (``seed_shift``): the same policy, independent
  draws, so wins and losses are exchangeable; the boundary of "no better", the test's worst case;
- *better*: the later checkpoint against the incumbent, on the same problems and seeds.

Beside each, the rule before issue 27 (publish when the candidate's mean reward is at least the
incumbent's, on the same problems) is counted on the same rewards.

    PYTHONPATH=. .venv/bin/python -m headrace run --backend torch --model tiny --env arithmetic \\
        --steps 60 --save-every 10 --set checkpoint.keep_last=0 --run-dir /tmp/gate-run
    PYTHONPATH=. .venv/bin/python benchmarks/serve_gate.py --run-dir /tmp/gate-run \\
        --incumbent-step 30 --better-step 40 60 --trials 200

Prints the shares accepted (with exact 95% intervals) and writes benchmarks/out/serve_gate.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from headrace.core.sampler import SamplerActor
from headrace.run.backends import make_backend
from headrace.run.config import build_config
from headrace.serve.gate import EnvGate
from headrace.serve.paired import binom_tail, lower_bound


def interval(k: int, n: int) -> tuple[float, float]:
    """Exact two-sided 95% (Clopper-Pearson) interval of a share k/n."""
    lo = lower_bound(k, n, 0.025)
    hi = 1.0 - lower_bound(n - k, n, 0.025)
    return lo, hi


async def main(args: argparse.Namespace) -> dict:
    overrides = [
        "serve.gate=env", "serve.gate_env=arithmetic", "serve.gate_improve=true",
        f"serve.gate_problems={args.problems}", f"serve.gate_samples={args.samples}",
        f"serve.gate_temperature={args.temperature}", f"serve.gate_alpha={args.alpha}",
    ]  # fmt: skip
    config = build_config(flags={"backend": "torch", "model": "tiny", "env": "arithmetic"}, overrides=overrides)
    ckpt = Path(args.run_dir) / "checkpoints"
    async with make_backend(config) as backend:
        training = backend.training
        await training.load_state(str(ckpt / f"step_{args.incumbent_step:06d}"))
        incumbent = await training.publish(1)
        twin = await training.fork()
        identical = await twin.publish(2)  # the same weights, a separate version
        states, betters = [twin], {}
        for k, step in enumerate(args.better_step):
            state = await training.fork()
            await state.load_state(str(ckpt / f"step_{step:06d}"))
            betters[f"step {step}"] = await state.publish(3 + k)
            states.append(state)
        sampler = SamplerActor(backend.sampling, incumbent)
        counts = {"identical": 0, "null": 0, **dict.fromkeys(betters, 0)}
        effects: dict[str, list[float]] = {k: [] for k in counts}
        ties: dict[str, list[int]] = {k: [] for k in counts}
        old_rule = dict.fromkeys(counts, 0)  # the rule before issue 27: candidate's mean >= incumbent's
        means: dict[str, list[float]] = {"incumbent": [], **{k: [] for k in betters}}
        started = time.monotonic()
        for trial in range(args.trials):
            gate = EnvGate(config, backend, sampler, seed=trial)
            base = await gate.rewards(incumbent)
            runs = {
                "identical": await gate.rewards(identical),
                "null": await gate.rewards(incumbent, seed_shift=10_000_000),
                **{name: await gate.rewards(handle) for name, handle in betters.items()},
            }
            for name, cand in runs.items():
                verdict = gate.decide(cand, base)
                counts[name] += verdict["passed"]
                effects[name].append(verdict["improve"]["effect"])
                ties[name].append(verdict["improve"]["ties"])
                old_rule[name] += verdict["candidate"] >= verdict["incumbent"]
                if name in means:
                    means[name].append(verdict["candidate"])
            means["incumbent"].append(verdict["incumbent"])
            if (trial + 1) % 20 == 0:
                print(f"trial {trial + 1}: accepted {counts} ({time.monotonic() - started:.0f} s)", flush=True)
        for state in states:
            await state.close()
    n = args.trials
    out = {
        "settings": vars(args),
        "trials": n,
        "accepted": counts,
        "share": {k: v / n for k, v in counts.items()},
        "interval95": {k: interval(v, n) for k, v in counts.items()},
        "mean_effect": {k: sum(v) / n for k, v in effects.items()},
        "mean_ties": {k: sum(v) / n for k, v in ties.items()},
        "old_rule_accepted": old_rule,
        "mean_reward": {k: sum(v) / n for k, v in means.items()},
        # what the exact test promises for the null: P(accept) <= alpha; P(>= k of n | alpha) for the count seen
        "null_tail_at_alpha": binom_tail(counts["null"], n, args.alpha),
        "seconds": time.monotonic() - started,
    }
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, help="a `headrace run` directory with step checkpoints")
    parser.add_argument("--incumbent-step", type=int, default=20)
    parser.add_argument("--better-step", type=int, nargs="+", default=[60])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--out", default=str(Path(__file__).parent / "out" / "serve_gate.json"))
    args = parser.parse_args()
    result = asyncio.run(main(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("accepted", "share", "interval95", "old_rule_accepted", "mean_reward", "mean_ties", "seconds")
            },
            indent=2,
        )
    )
