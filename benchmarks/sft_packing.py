"""SFT's training throughput with sequence packing (``torch.pack``) against padded rows, back to
back on one backend: the same steps alternately packed and padded, real tokens per second.

    python benchmarks/sft_packing.py --model smollm2-135m --steps 6 --batch 16 --min-len 24 --max-len 320

Each step is a ``cross_entropy`` ``forward_backward`` + ``optim_step`` of ``--batch`` datums of
lengths drawn uniformly in [min-len, max-len] (chat SFT examples differ this much), the loss on
their second half. Printed: one JSON line, tokens/s of each layout (median of its steps), the
ratio, and the mean loss of each (the same data: they must agree).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

from headrace.core.types import AdamParams, Datum, LossSpec
from headrace.run.backends import make_backend
from headrace.run.config import build_config
from headrace.run.defaults import apply_model_defaults


def datums(rng: random.Random, n: int, low: int, high: int, vocab: int) -> list[Datum]:
    out = []
    for _ in range(n):
        k = rng.randint(low, high)
        tokens = [rng.randrange(1, vocab) for _ in range(k + 1)]
        mask = [0.0] * (k // 2) + [1.0] * (k - k // 2)
        w = [m / (k - k // 2) for m in mask]
        out.append(Datum(tokens[:-1], tokens[1:], [0.0] * k, [0.0] * k, w))
    return out


async def main(args: argparse.Namespace) -> dict:
    config = apply_model_defaults(
        build_config(flags={"model": args.model, "run_dir": None}, overrides=["torch.num_threads=1"])
    )
    rng = random.Random(0)
    times: dict[bool, list[float]] = {True: [], False: []}
    losses: dict[bool, list[float]] = {True: [], False: []}
    tokens = 0
    async with make_backend(config) as backend:
        trainer = backend.training
        vocab = backend.tokenizer.vocab_size
        adam = AdamParams(learning_rate=0.0)  # the weights stay put: both layouts see the same model
        for step in range(args.steps):
            batch = datums(rng, args.batch, args.min_len, args.max_len, vocab)
            tokens = sum(len(d.model_input) for d in batch)
            for packed in (step % 2 == 0, step % 2 != 0):  # alternate which goes first
                trainer.pack = packed
                started = time.perf_counter()
                out = await trainer.forward_backward(batch, LossSpec("cross_entropy"))
                await trainer.optim_step(adam)
                times[packed].append(tokens / (time.perf_counter() - started))
                losses[packed].append(out.metrics["optim/loss"])
    return {
        "model": args.model,
        "batch": args.batch,
        "lengths": [args.min_len, args.max_len],
        "steps": args.steps,
        "tokens_per_s": {"packed": statistics.median(times[True]), "padded": statistics.median(times[False])},
        "ratio": statistics.median(times[True]) / statistics.median(times[False]),
        "loss": {"packed": statistics.mean(losses[True]), "padded": statistics.mean(losses[False])},
        "load": os.getloadavg()[0],
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--min-len", type=int, default=24)
    p.add_argument("--max-len", type=int, default=320)
    print(json.dumps(asyncio.run(main(p.parse_args()))))
