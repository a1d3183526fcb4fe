"""``headrace dpo``: direct preference optimisation (Rafailov et al., 2023) on the run's learner.

For a pair (prompt x, chosen y+, rejected y-), with log π(y|x) summed over the reply's tokens and
π_ref the frozen reference (the run's starting weights: the base with the adapter off for LoRA,
as ``loss.kl_coef`` uses; on Tinker a sampling client of the base model):

    z = β · [(log π(y+|x) - log π_ref(y+|x)) - (log π(y-|x) - log π_ref(y-|x))],  loss = -log σ(z)

The reference's logprobs are computed once, before training (they never change). Each step is
one ``forward_backward_custom`` (the loss over the batch's pairs, its mean, from the policy's
per-token logprobs) and one ``optim_step``. The metrics are the cookbook's: the preference
accuracy (z > 0), the margin z/β, and the implicit rewards β·(log π - log π_ref) of each side."""

from __future__ import annotations

from typing import Any

from headrace.core import logs
from headrace.core.errors import ConfigError
from headrace.core.protocols import ComputesCustomLoss, ScoresReference
from headrace.core.types import Datum
from headrace.renderers import renderer_for
from headrace.run.config import RunConfig

from .config import DPOConfig
from .data import Record, preference, train_and_test
from .loop import Session, session
from .render import render, to_datum
from .steps import run_steps, schedule

log = logs.get_logger()


def pairs_of(s: Session, records: list[Record], what: str, max_length: int) -> list[tuple[Datum, Datum]]:
    renderer = renderer_for(s.config.model, s.backend.tokenizer, s.config.renderer)
    out = []
    for i, record in enumerate(records):
        prompt, chosen, rejected = preference(record, f"{what} pair {i}")
        sides = []
        for reply in (chosen, rejected):
            tokens, weights = render(renderer, s.backend.tokenizer, [*prompt, *reply], first=len(prompt))
            sides.append(to_datum(tokens, weights, max_length))
        if all(d.num_loss_tokens for d in sides):
            out.append((sides[0], sides[1]))
    if not out:
        raise ConfigError(f"{what}: no pair has reply tokens to compare (each needs a chosen and a rejected reply)")
    return out


def summed(datum: Datum, logprobs: Any) -> Any:
    """log π(reply | prompt): the logprobs summed over the reply's tokens (a float or a tensor)."""
    if isinstance(logprobs, list):
        return sum(lp * m for lp, m in zip(logprobs, datum.mask, strict=False) if m)
    import torch

    mask = torch.tensor(datum.mask[: logprobs.shape[-1]], dtype=logprobs.dtype)
    return (logprobs * mask).sum()


def figures(beta: float, policy: list[tuple[Any, Any]], reference: list[tuple[float, float]], prefix: str) -> dict:
    """The loss (a torch scalar) and the metrics of a batch of pairs, from summed logprobs."""
    import torch
    import torch.nn.functional as F

    pol = torch.stack([torch.stack([torch.as_tensor(c), torch.as_tensor(r)]) for c, r in policy]).float()
    ref = torch.tensor(reference, dtype=pol.dtype)
    rewards = beta * (pol - ref)  # the implicit rewards, [pairs, (chosen, rejected)]
    z = rewards[:, 0] - rewards[:, 1]
    loss = -F.logsigmoid(z).mean()
    with torch.no_grad():
        metrics = {
            f"{prefix}/loss": float(loss),
            f"{prefix}/accuracy": float((z > 0).float().mean()),
            f"{prefix}/margin": float((z / beta).mean()),
            f"{prefix}/chosen_reward": float(rewards[:, 0].mean()),
            f"{prefix}/rejected_reward": float(rewards[:, 1].mean()),
            f"{prefix}/chosen_logprob": float(pol[:, 0].mean()),
            f"{prefix}/rejected_logprob": float(pol[:, 1].mean()),
        }
    return {"loss": loss, "metrics": metrics}


async def dpo(config: RunConfig, view: Any = None) -> Session:
    opts: DPOConfig = config.section("dpo")
    train_records, test_records = train_and_test(
        "headrace dpo",
        "a JSONL or Parquet file of prompt/chosen/rejected pairs",
        opts.data,
        opts.test_data,
        opts.test_fraction,
        config.seed,
    )
    async with session(config, view) as s:
        training = s.backend.training
        if not isinstance(training, ComputesCustomLoss) or not isinstance(training, ScoresReference):
            raise ConfigError(
                f"headrace dpo needs a training backend with a custom loss and a frozen reference "
                f"(ComputesCustomLoss, ScoresReference); '{config.backend}' has "
                f"{'neither' if not isinstance(training, ScoresReference) else 'no custom loss'}. Use torch or tinker."
            )
        train = pairs_of(s, train_records, f"--data {opts.data}", opts.max_length)
        test = pairs_of(s, test_records, "held-out", opts.max_length)[: opts.max_test] if test_records else []

        async def reference(pairs: list[tuple[Datum, Datum]]) -> list[tuple[float, float]]:
            flat = [d for pair in pairs for d in pair]
            rows = await training.reference_logprobs(flat)
            sums = [float(summed(d, row)) for d, row in zip(flat, rows, strict=True)]
            return list(zip(sums[0::2], sums[1::2], strict=True))

        ref_train, ref_test = await reference(train), (await reference(test) if test else [])
        sizes = [len(c.model_input) + len(r.model_input) for c, r in train]
        plan = schedule(sizes, opts.batch_tokens, opts.epochs, config.steps, config.seed)
        per_epoch = len(schedule(sizes, opts.batch_tokens, 1.0, 10**9, config.seed))
        log.info("dpo_data", train=len(train), test=len(test), steps=len(plan), steps_per_epoch=per_epoch)

        def submit(k: int):
            batch = plan[k]
            flat = [d for i in batch for d in train[i]]
            refs = [ref_train[i] for i in batch]
            seen: dict[str, float] = {}

            def loss_fn(datums: Any, logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
                sums = [summed(d, lp) for d, lp in zip(datums, logprobs, strict=True)]
                out = figures(opts.beta, list(zip(sums[0::2], sums[1::2], strict=True)), refs, "dpo")
                seen.update(out["metrics"])
                return out["loss"], out["metrics"]

            fb = training.forward_backward_custom(flat, loss_fn)
            opt = training.optim_step(s.adam)

            async def result() -> dict[str, Any]:
                await fb
                step = await opt
                return {**seen, "dpo/pairs": float(len(batch)), "dpo/epoch": (k + 1) / per_epoch, **step.metrics}

            return result()

        async def evaluate(trained: int) -> dict[str, float]:
            out: dict[str, float] = {}
            if test:
                flat = [d for pair in test for d in pair]
                rows = await s.forward(flat)
                sums = [summed(d, row) for d, row in zip(flat, rows, strict=True)]
                out |= figures(opts.beta, list(zip(sums[0::2], sums[1::2], strict=True)), ref_test, "test")["metrics"]
            return out | await s.env_figures(opts.env, trained, len(plan))

        await run_steps(s, len(plan), submit, evaluate, opts.eval_every)
        return s
