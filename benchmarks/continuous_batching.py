"""The torch sampler alone under a stream of requests that arrive while others decode, as under
``async`` and ``inflight`` (issue 24, "Continuous batching"): groups of ``--group`` samples of one
prompt, of mixed lengths (``max_tokens`` drawn from 2..``--max-tokens``), issued ``--every`` seconds
apart, ``--requests`` in all. Prints sampled tokens per wall second and per device second, the
sampler's busy fraction (its device seconds over the wall time) and the mean decode batch.

    python benchmarks/continuous_batching.py [--model tiny] [--requests 48] [--group 8]
        [--max-tokens 24] [--every 0.01]

Run it from two trees back to back (``PYTHONPATH=TREE``) to compare them; nothing here depends
on this tree's own figures beyond ``perf/…`` (a tree without ``perf/sampler_busy`` reports its
busy fraction from ``perf/sample_s`` over the wall time, the same thing).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import torch

from headrace.backends.torch.config import TorchConfig
from headrace.core.types import SamplingParams
from headrace.run.backends import make_backend
from headrace.run.config import RunConfig


async def run(model: str, requests: int, group: int, max_tokens: int, every: float, seed: int) -> dict[str, float]:
    config = RunConfig(seed=0, model=model, torch=TorchConfig(device="cpu", num_threads=1))
    async with make_backend(config) as backend:
        sampler, handle, tok = backend.sampling, backend.initial_handle(), backend.tokenizer
        rng = random.Random(seed)
        prompts = [tok.encode(f"What is {rng.randint(0, 99)}+{rng.randint(0, 99)}?") for _ in range(requests)]
        lengths = [rng.randint(2, max_tokens) for _ in range(requests)]
        # warm-up (first forwards allocate), then drop what it metered
        await sampler.sample(handle, prompts[0], group, SamplingParams(max_tokens=2, seed=1))
        backend.meter.drain()
        start = time.perf_counter()

        async def one(i: int) -> int:
            await asyncio.sleep(i * every)
            params = SamplingParams(max_tokens=lengths[i], temperature=1.0, seed=i)
            out = await sampler.sample(handle, prompts[i], group, params)
            return sum(len(s.tokens) for s in out)

        tokens = sum(await asyncio.gather(*[one(i) for i in range(requests)]))
        wall = time.perf_counter() - start
        perf = backend.meter.drain()
    sample_s = perf.get("perf/sample_s", 0.0)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_wall_s": tokens / wall,
        "tokens_per_device_s": tokens / sample_s if sample_s else float("nan"),
        "busy": sample_s / wall,
        "decode_rows": perf.get("perf/decode_rows", float("nan")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--every", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    figures = asyncio.run(run(args.model, args.requests, args.group, args.max_tokens, args.every, args.seed))
    print(" ".join(f"{k}={v:.4g}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
