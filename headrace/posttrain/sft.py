"""``headrace sft``: supervised fine-tuning on chat conversations, the loss on assistant tokens.

Each step is one ``cross_entropy`` ``forward_backward`` of a token-budget batch and one
``optim_step``. The weights are scaled by 1 / (the step's loss tokens) here, so the update is the
per-token mean on every backend: the torch trainer divides by the weights' sum (then 1) and
Tinker applies the sum as it is."""

from __future__ import annotations

import math
from typing import Any

from headrace.core import logs
from headrace.core.errors import ConfigError
from headrace.core.types import Datum, LossSpec
from headrace.renderers import renderer_for
from headrace.run.config import RunConfig

from .config import SFTConfig
from .data import Record, conversation, train_and_test
from .loop import Session, session
from .render import render, scaled, to_datum
from .steps import run_steps, schedule

log = logs.get_logger()


def datums_of(s: Session, records: list[Record], what: str, train_on: str, max_length: int) -> list[Datum]:
    renderer = renderer_for(s.config.model, s.backend.tokenizer, s.config.renderer)
    out = []
    for i, record in enumerate(records):
        tokens, weights = render(renderer, s.backend.tokenizer, conversation(record, f"{what} example {i}"), train_on)
        datum = to_datum(tokens, weights, max_length)
        if datum.num_loss_tokens:
            out.append(datum)
    if not out:
        raise ConfigError(f"{what}: no example has an assistant token to train on (each needs an assistant turn)")
    return out


def nll(datums: list[Datum], logprobs_D: list[list[float]]) -> tuple[float, float]:
    """(summed -logprob over the weighted tokens, their weight)."""
    total = weight = 0.0
    for d, row in zip(datums, logprobs_D, strict=True):
        for lp, m in zip(row, d.mask, strict=False):
            if m:
                total -= m * lp
                weight += m
    return total, weight


async def sft(config: RunConfig, view: Any = None) -> Session:
    opts: SFTConfig = config.section("sft")
    train_records, test_records = train_and_test(
        "headrace sft",
        "a JSONL or Parquet file of conversations",
        opts.data,
        opts.test_data,
        opts.test_fraction,
        config.seed,
    )
    async with session(config, view) as s:
        train = datums_of(s, train_records, f"--data {opts.data}", opts.train_on, opts.max_length)
        test = (
            datums_of(s, test_records, "held-out", opts.train_on, opts.max_length)[: opts.max_test]
            if test_records
            else []
        )
        plan = schedule([len(d.model_input) for d in train], opts.batch_tokens, opts.epochs, config.steps, config.seed)
        per_epoch = len(schedule([len(d.model_input) for d in train], opts.batch_tokens, 1.0, 10**9, config.seed))
        log.info("sft_data", train=len(train), test=len(test), steps=len(plan), steps_per_epoch=per_epoch)
        training = s.backend.training

        def submit(k: int):
            batch = [train[i] for i in plan[k]]
            tokens = sum(d.num_loss_tokens for d in batch)
            weight = sum(sum(d.mask) for d in batch)
            fb = training.forward_backward([scaled(d, 1.0 / weight) for d in batch], LossSpec("cross_entropy"))
            opt = training.optim_step(s.adam)

            async def result() -> dict[str, Any]:
                out, step = await fb, await opt
                total, w = nll(batch, out.logprobs_D)
                return {
                    "sft/train_nll": total / w,
                    "sft/examples": float(len(batch)),
                    "sft/loss_tokens": float(tokens),
                    "sft/epoch": (k + 1) / per_epoch,
                    **{key: v for key, v in step.metrics.items()},
                }

            return result()

        async def evaluate(trained: int) -> dict[str, float]:
            figures: dict[str, float] = {}
            if test:
                total, w = nll(test, await s.forward(test))
                figures["test/nll"] = total / w
            return figures | await s.env_figures(opts.env, trained, len(plan))

        await run_steps(s, len(plan), submit, evaluate, opts.eval_every)
        return s


def summary(s: Session) -> str:
    rows = s.rows
    if not rows:
        return f"{s.run_dir.path}: nothing to train (every step is done)"
    first, last = rows[0], rows[-1]
    parts = [f"{s.run_dir.path}: steps {first['step']}..{last['step']}"]
    for key in sorted(k for k in first if "/start_" in k):
        end = key.replace("/start_", "/")
        if end in last and isinstance(last[end], float) and not math.isnan(last[end]):
            parts.append(f"{end} {first[key]:.4f} -> {last[end]:.4f}")
    for key in ("sft/train_nll", "dpo/loss", "dpo/accuracy"):
        if key in first:
            parts.append(f"{key} {first[key]:.4f} -> {last[key]:.4f}")
    if s.exported:
        parts.append(f"final weights: {s.exported}")
    return "; ".join(parts)
