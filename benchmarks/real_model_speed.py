"""The real-model job of issue 24, per dtype, back to back in one process: a GRPO step's sampling
(8 prompts x 8 samples, 16 tokens, the chat arithmetic env's prompts) and its training
(forward_backward of the 64 sequences, every group trained, then optim_step), on the torch
backend, LoRA 16, one torch thread.

    python benchmarks/real_model_speed.py [--model smollm2-135m] [--dtypes float32,bfloat16]
        [--steps 3] [--profile DIR]   # --dtypes float32:sdpa,auto: the old default against the new

Prints, per dtype, the median over ``--steps`` (after one warm-up step) of sampling seconds,
training seconds, sampled tokens/s and the perf/… figures the backend writes into each row (MFU
against the peak probed in that dtype), then each dtype's speed-up over the first one; and what
the machine did meanwhile: the share of CPU time the hypervisor took (steal, Linux) and the
process's minor page faults and system CPU seconds a step (each fault in of a fresh page costs
~2 µs on a VM, far more in a freshly booted one), the two things that moved these figures most
between runs on the shared machines.
``--profile DIR``: a torch.profiler table of one step per dtype, into DIR/<dtype>.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import time
from pathlib import Path

import psutil
import torch

from headrace.backends.torch.config import TorchConfig
from headrace.core.types import AdamParams, Datum, LossSpec, SamplingParams
from headrace.run.backends import make_backend
from headrace.run.config import RunConfig

QUESTIONS = [f"What is {a}+{b}? Answer with the number only." for a, b in ((3, 4), (1, 8), (7, 7), (2, 5))] + [
    f"What is {a}+{b}? Answer with the number only." for a, b in ((9, 0), (6, 3), (4, 4), (8, 1))
]


def datums_of(prompt: list[int], samples, advantages) -> list[Datum]:
    out = []
    for s, a in zip(samples, advantages, strict=True):
        seq = prompt + s.tokens
        n = len(prompt) - 1
        mask = [0.0] * n + [1.0] * len(s.tokens)
        out.append(Datum(seq[:-1], seq[1:], [0.0] * n + list(s.logprobs), [a * m for m in mask], mask))
    return out


async def one_step(backend, handle, prompts, seed: int, reuse: list | None = None, sample_only: bool = False):
    """One step; ``reuse``: sample only if it is empty, then train on its groups (--train-only);
    ``sample_only``: no training (--sample-only)."""
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed)
    start = time.perf_counter()
    if reuse:
        groups = reuse
    else:
        groups = await asyncio.gather(*[backend.sampling.sample(handle, p, 8, params) for p in prompts])
        if reuse is not None:
            reuse.extend(groups)
            start = time.perf_counter()
    sampled = time.perf_counter()
    if sample_only:
        tokens = sum(len(s.tokens) for g in groups for s in g)
        return sampled - start, 0.0, tokens, backend.meter.drain()  # the sampler's perf/… alone
    datums = []
    for p, g in zip(prompts, groups, strict=True):
        datums += datums_of(p, g, [1.0 if i % 2 else -1.0 for i in range(len(g))])
    await backend.training.forward_backward(datums, LossSpec("importance_sampling"))
    result = await backend.training.optim_step(AdamParams(learning_rate=1e-5))
    trained = time.perf_counter()
    tokens = sum(len(s.tokens) for g in groups for s in g)
    return sampled - start, trained - sampled, tokens, result.metrics


async def measure(
    model: str,
    spec: str,
    steps: int,
    profile: Path | None,
    lora_rank: int = 16,
    train_only: bool = False,
    sets: tuple[str, ...] = (),
    sample_only: bool = False,
) -> dict[str, float]:
    # "float32:sdpa": that dtype and attention kernel; "auto+compile=true": and a [torch] setting
    head, *settings = spec.split("+")
    dtype, _, attention = head.partition(":")
    extra = dict(s.split("=", 1) for s in (*sets, *settings))  # key=value of the [torch] section
    section = TorchConfig(dtype=dtype, attention=attention or "auto", num_threads=1, lora_rank=lora_rank, **extra)
    config = RunConfig(model=model, seed=0, torch=section)
    async with make_backend(config) as backend:
        hf = backend.loaded.hf_tokenizer() if backend.loaded.hf_tokenizer is not None else None
        if hf is not None and getattr(hf, "chat_template", None):  # the chat prompt the env renders
            renderer_prompts = [
                backend.tokenizer.encode(
                    hf.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
                )
                for q in QUESTIONS
            ]
        else:
            renderer_prompts = [backend.tokenizer.encode(q) for q in QUESTIONS]
        handle = backend.initial_handle()
        reuse: list | None = [] if train_only else None  # the warm-up's samples, trained on every step
        warm_start = time.perf_counter()
        warm = await one_step(
            backend, handle, renderer_prompts, seed=99, reuse=reuse, sample_only=sample_only
        )  # warm-up (and the peak probe)
        print(f"{spec}: warm-up step {time.perf_counter() - warm_start:.1f} s (train {warm[1]:.1f} s)", flush=True)
        rows = []
        cpu_before, usage_before = psutil.cpu_times(), resource.getrusage(resource.RUSAGE_SELF)
        for i in range(steps):
            rows.append(await one_step(backend, handle, renderer_prompts, seed=i, reuse=reuse, sample_only=sample_only))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        faults, system_s = usage.ru_minflt - usage_before.ru_minflt, usage.ru_stime - usage_before.ru_stime
        steal = _steal_share(cpu_before, psutil.cpu_times())
        if profile is not None:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            # every thread: the backend's work runs on its device thread, started before the profile
            every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
            with torch_profile(
                activities=[ProfilerActivity.CPU], experimental_config=every_thread, record_shapes=True
            ) as prof:
                await one_step(backend, handle, renderer_prompts, seed=123, reuse=reuse, sample_only=sample_only)
            profile.mkdir(parents=True, exist_ok=True)
            name = spec.replace(":", "-").replace("+", "-").replace("=", "") + ("-train" if train_only else "")
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            (profile / f"{name}.txt").write_text(table)
            shapes = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=40)
            (profile / f"{name}-shapes.txt").write_text(shapes)
        resolved = backend.describe()["dtype"]
    out = {
        "sample_s": statistics.median(r[0] for r in rows),
        "train_s": statistics.median(r[1] for r in rows),
        "tokens": statistics.median(r[2] for r in rows),
    }
    out["step_s"] = out["sample_s"] + out["train_s"]
    out["sample_tok_per_s"] = out["tokens"] / max(out["sample_s"], 1e-9)
    keys = ("perf/mfu_train", "perf/mfu_sample", "perf/train_flops_per_s", "perf/peak_flops_per_s", "perf/sampler_busy")
    for key in keys:
        out[key] = statistics.median(r[3].get(key, float("nan")) for r in rows)
    out["resolved"] = resolved  # type: ignore[assignment]
    out["faults_per_step"] = faults / max(steps, 1)
    out["system_s_per_step"] = system_s / max(steps, 1)
    out["steal"] = steal
    return out


def _steal_share(before, after) -> float:
    """The time the hypervisor ran something else (steal, Linux only) over all CPU time between
    two ``psutil.cpu_times()``; guest time is already counted in user, so it is left out."""
    if not hasattr(before, "steal"):
        return float("nan")
    fields = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    total = sum(getattr(after, f) - getattr(before, f) for f in fields)
    return (after.steal - before.steal) / total if total > 0 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--dtypes", default="float32,bfloat16", help="comma-separated torch.dtype values, each optionally :attention"
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--lora-rank", type=int, default=16, help="0: full fine-tuning")
    parser.add_argument(
        "--train-only", action="store_true", help="sample once (the warm-up), then time training on those samples"
    )
    parser.add_argument("--set", action="append", default=[], help="torch.KEY=VALUE for every dtype (repeatable)")
    parser.add_argument("--sample-only", action="store_true", help="sampling alone, no training step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sets = tuple(s.removeprefix("torch.") for s in args.set)
    results = {
        d: asyncio.run(
            measure(args.model, d, args.steps, args.profile, args.lora_rank, args.train_only, sets, args.sample_only)
        )
        for d in args.dtypes.split(",")
    }
    first = next(iter(results.values()))
    for dtype, r in results.items():
        print(
            f"{args.model} {dtype} (ran as {r['resolved']}): step {r['step_s']:.2f} s = sample {r['sample_s']:.2f} s "
            f"+ train {r['train_s']:.2f} s; {r['sample_tok_per_s']:.1f} sampled tok/s; "
            f"mfu_train {r['perf/mfu_train']:.1%}, mfu_sample {r['perf/mfu_sample']:.1%}, "
            f"sampler busy {r['perf/sampler_busy']:.2f} "
            f"(peak {r['perf/peak_flops_per_s'] / 1e9:.0f} GFLOP/s), train {r['perf/train_flops_per_s'] / 1e9:.1f} "
            f"GFLOP/s; vs {next(iter(results))}: step {first['step_s'] / r['step_s']:.2f}x, "
            f"sampling {r['sample_tok_per_s'] / first['sample_tok_per_s']:.2f}x; "
            f"host steal {r['steal']:.0%}, {r['faults_per_step'] / 1e3:.0f}k minor faults "
            f"and {r['system_s_per_step']:.2f} s of the kernel's time (system CPU) a step"
        )


if __name__ == "__main__":
    main()
