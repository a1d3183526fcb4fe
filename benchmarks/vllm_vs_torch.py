"""Sampled tokens/s of the vLLM sampler vs the torch sampler, same model, same run, several batch sizes.

Both samplers come from one ``--sampler vllm`` backend: ``backend.sampling`` is vLLM (in-process
engine), ``backend.inner.sampling`` is the torch backend's own batched KV-cache sampler, on the
same published weights (version 0). A "batch" of B is B concurrent ``sample(n=1)`` calls with
distinct prompts, as rollout workers issue them; each sampler batches them its own way. Tokens
counted are the tokens actually sampled (a sample may stop early at EOS in both samplers).
On CPU the torch side runs one thread (``--torch-threads``), as vLLM's CPU engine does: two
threads on a busy 2-core machine run the tiny model 10x slower (OpenMP barriers spin).

    python benchmarks/vllm_vs_torch.py                       # tiny random model, CPU
    python benchmarks/vllm_vs_torch.py --model DIR --batch-sizes 1 16 64 256 --max-tokens 128
    python benchmarks/vllm_vs_torch.py --preset 0.5b --dtype bfloat16 --train lora full   # GPU

``--train MODE ...`` also measures the torch learner: ``forward_backward`` + ``optim_step`` +
``publish`` per step on fixed-length datums (LoRA at ``--lora-rank``, or full fine-tuning), and
for LoRA the time vLLM takes to start sampling from a newly published version.

Without vLLM installed only the torch sampler is measured (the result says so). Writes
benchmarks/out/vllm_vs_torch.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from headrace.backends.vllm import vllm_available
from headrace.core.types import AdamParams, Datum, LossSpec, SamplingParams
from headrace.plugins.backends import build, get_plugin
from headrace.run.backends import make_backend
from headrace.run.config import build_config


async def measure(sample, handle, batch: int, max_tokens: int, rounds: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    rates, latencies = [], []
    for r in range(rounds + 1):  # round 0 warms up (allocations, kernels, adapter load)
        prompts = [[1] + [rng.randrange(4, 56) for _ in range(rng.randrange(4, 12))] for _ in range(batch)]
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=rng.getrandbits(31)) for _ in range(batch)
        ]
        start = time.perf_counter()
        results = await asyncio.gather(*(sample(handle, p, 1, sp) for p, sp in zip(prompts, params, strict=True)))
        wall = time.perf_counter() - start
        tokens = sum(len(s.tokens) for res in results for s in res)
        if r:
            rates.append(tokens / wall)
            latencies.append(wall)
    return {"tokens_per_s": statistics.median(rates), "batch_wall_s": statistics.median(latencies),
            "tokens_per_s_min": min(rates), "tokens_per_s_max": max(rates)}  # fmt: skip


def make_config(args: argparse.Namespace, model: str, lora_rank: int, sampler: str | None):
    overrides = [
        f"torch.lora_rank={lora_rank}",
        f'torch.dtype="{args.dtype}"',
        f"torch.max_sample_batch={max(args.batch_sizes)}",
        f"vllm.max_model_len={args.max_model_len}",
        f"vllm.gpu_memory_utilization={args.gpu_memory_utilization}",
    ]
    if args.device:
        overrides.append(f'torch.device="{args.device}"')
    if args.torch_threads:
        overrides.append(f"torch.num_threads={args.torch_threads}")
    return build_config(flags={"model": model, "sampler": sampler, "progress": False}, overrides=overrides)


async def measure_training(config, steps: int, batch: int, length: int) -> dict[str, float]:
    """Tokens/s of forward_backward + optim_step + publish, pipelined as the learner submits them."""
    rng = random.Random(0)
    vocab = 56  # the character tokenizer's ids: valid in every model built here
    datums = []
    for i in range(batch):
        tokens = [rng.randrange(4, vocab) for _ in range(length + 1)]
        datums.append(
            Datum(tokens[:-1], tokens[1:], [-1.0] * length, [1.0 if i % 2 else -1.0] * length, [1.0] * length)
        )
    backend = make_backend(config.model_copy(update={"sampler": None}))
    adam = AdamParams(learning_rate=1e-5)
    async with backend:
        training = backend.training
        walls = []
        for step in range(steps + 1):  # step 0 warms up
            start = time.perf_counter()
            fb = training.forward_backward(datums, LossSpec("importance_sampling"))
            opt = training.optim_step(adam)
            pub = training.publish(step + 1)
            await fb
            await opt
            await pub
            if step:
                walls.append(time.perf_counter() - start)
        facts = backend.describe()
    step_s = statistics.median(walls)
    return {"tokens_per_s": batch * length / step_s, "step_s": step_s, "tokens_per_step": batch * length,
            "trainable_params": facts.get("trainable_params"), "total_params": facts.get("total_params")}  # fmt: skip


async def measure_sampling(args: argparse.Namespace, model: str, results: dict[str, Any]) -> None:
    use_vllm = vllm_available() and not args.no_vllm
    config = make_config(args, model, args.lora_rank, "vllm" if use_vllm else None)
    started = time.perf_counter()
    inner = make_backend(config.model_copy(update={"sampler": None}))
    backend = build(get_plugin("vllm"), config, inner) if use_vllm else inner
    async with backend:
        results["startup_s"] = time.perf_counter() - started
        handle = backend.initial_handle()
        samplers = {"torch": inner.sampling.sample}
        if use_vllm:
            samplers = {"vllm": backend.sampling.sample, **samplers}
        else:
            results["vllm"] = "skipped: " + ("--no-vllm" if args.no_vllm else "vLLM is not installed here")
        for name, sample in samplers.items():
            await asyncio.sleep(3)  # vLLM's CPU worker spins for a moment after its last request
            rows = results["samplers"][name] = {}
            for batch in args.batch_sizes:
                rows[str(batch)] = await measure(sample, handle, batch, args.max_tokens, args.rounds, seed=batch)
                print(f"{name:>5}  batch {batch:>4}: {rows[str(batch)]['tokens_per_s']:10.0f} tokens/s", flush=True)
        if use_vllm and args.lora_rank > 0:
            results["vllm_new_version_s"] = await measure_version_swap(backend, handle)
        results["describe"] = {k: v for k, v in backend.describe().items() if isinstance(v, (int, float, str))}


async def measure_version_swap(backend, handle) -> float:
    """Extra latency of the first request on a newly published LoRA version (save + load adapter)."""
    params = SamplingParams(max_tokens=1, seed=0)
    prompt = [1, 5, 6]
    await backend.sampling.sample(handle, prompt, 1, params)
    start = time.perf_counter()
    await backend.sampling.sample(handle, prompt, 1, params)
    same = time.perf_counter() - start
    new = await backend.training.publish(handle.version + 1)
    start = time.perf_counter()
    await backend.sampling.sample(new, prompt, 1, params)
    return time.perf_counter() - start - same


async def main(args: argparse.Namespace) -> dict[str, Any]:
    tmp = None
    model = args.model
    results: dict[str, Any] = {"samplers": {}, "training": {}}
    if model is None:
        from headrace.backends.vllm.models import save_random_llama

        tmp = tempfile.TemporaryDirectory(prefix="headrace-bench-model-")
        start = time.perf_counter()
        model = str(save_random_llama(tmp.name, args.preset, seed=0, initializer_range=0.3, dtype=args.dtype))
        results["model_build_s"] = time.perf_counter() - start
    if not args.skip_sampling:
        await measure_sampling(args, model, results)
    for mode in args.train:
        rank = args.lora_rank if mode == "lora" else 0
        config = make_config(args, model, rank, None)
        results["training"][mode] = row = await measure_training(
            config, args.train_steps, args.train_batch, args.train_len
        )
        print(f"train {mode:>4}: {row['tokens_per_s']:10.0f} tokens/s ({row['step_s']:.3f} s/step)", flush=True)
    results |= {
        "model": args.model or f"random llama '{args.preset}'",
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "lora_rank": args.lora_rank,
        "torch_threads": args.torch_threads or "default",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_avg_1m": os.getloadavg()[0],
        },
    }
    if tmp is not None:
        tmp.cleanup()
    return results


def table(results: dict[str, Any]) -> str:
    samplers = results["samplers"]
    names = list(samplers)
    lines = []
    if names:
        head = " | ".join(f"{n} tokens/s" for n in names)
        lines += [f"| batch | {head} |" + (" vLLM / torch |" if len(names) == 2 else ""),
                  "|---:|" + "---:|" * (len(names) + (len(names) == 2))]  # fmt: skip
        for b in samplers[names[0]]:
            rates = [samplers[n][b]["tokens_per_s"] for n in names]
            ratio = f" {rates[0] / rates[1]:.2f}x |" if len(rates) == 2 else ""
            lines.append(f"| {b} | " + " | ".join(f"{r:,.0f}" for r in rates) + " |" + ratio)
    for mode, row in results["training"].items():
        lines.append(f"\ntraining ({mode}): {row['tokens_per_s']:,.0f} tokens/s, {row['step_s']:.3f} s per step of "
                     f"{row['tokens_per_step']} tokens ({row['trainable_params']:,} trainable parameters)")  # fmt: skip
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model directory; default: a random Llama (--preset)")
    p.add_argument("--preset", default="tiny", help="tiny | 0.5b (see headrace/backends/vllm/models.py)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default=None, help="torch device (default: auto)")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch.num_threads (0: the backend's default); vLLM's CPU engine uses one thread as well",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    p.add_argument("--no-vllm", action="store_true", help="measure the torch sampler only")
    p.add_argument("--skip-sampling", action="store_true")
    p.add_argument("--train", nargs="*", default=[], choices=["lora", "full"], help="also measure the torch learner")
    p.add_argument("--train-steps", type=int, default=3)
    p.add_argument("--train-batch", type=int, default=32, help="datums per step")
    p.add_argument("--train-len", type=int, default=256, help="tokens per datum")
    p.add_argument("--out", default=str(Path(__file__).parent / "out" / "vllm_vs_torch.json"))
    return p.parse_args(argv)


if __name__ == "__main__":  # vLLM's engine starts worker processes: keep the entry point guarded
    args = parse()
    results = asyncio.run(main(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    if "startup_s" in results:
        print(f"\nstartup (learner + samplers): {results['startup_s']:.1f} s; max_tokens={args.max_tokens}, "
              f"LoRA rank {args.lora_rank}; load average {results['machine']['load_avg_1m']:.1f}")  # fmt: skip
    if "vllm_new_version_s" in results:
        print(
            f"vLLM: a newly published LoRA version costs its first request {results['vllm_new_version_s']:.3f} s more"
        )
    if "vllm" in results:
        print(f"vLLM {results['vllm']}")
    print()
    print(table(results))
    print(f"\nwrote {out}")
