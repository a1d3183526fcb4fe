"""``headrace sdft``: self-distillation fine-tuning (after Shenfeld et al., 2026). The teacher is
the model itself with the demonstration in its prompt (``sdft.teacher_template``); the student,
without it, samples its own answer, and is trained at each of its sampled tokens toward the
teacher's ``sdft.top_k`` likeliest next tokens there (renormalised over those k): on-policy, so
the model learns the demonstration's content in its own words, which the paper finds forgets
less than SFT on the demonstration itself.

The teacher's weights are the run's starting weights, frozen (``sdft.teacher_sync_every = 0``,
the Tinker cookbook's default; the paper keeps an EMA of the student, alpha 0.01), or the current
weights taken every N steps. A teacher that is the current weights at every step (N = 1) trains
the model toward itself: whatever one step moves, the next step's teacher has moved too, and on
SmolLM2-135M six such steps took a second task's accuracy from 0.83 to 0 (benchmarks/RESULTS.md).

Both backends compute it with what they have: the teacher's top-k from a forward of the
teacher's weights (``ScoresTopK``: the torch sampler's forward, Tinker's
``topk_prompt_logprobs``), and the loss as ``cross_entropy`` over k copies of each sample whose
targets are the teacher's k tokens, weighted by their renormalised probabilities (so
Σ_j q_j · -log π(j), scaled to a mean over the sampled positions, as ``headrace sft`` scales)."""

from __future__ import annotations

import math
from typing import Any

from headrace.core import logs
from headrace.core.errors import ConfigError
from headrace.core.protocols import ScoresTopK
from headrace.core.types import Datum, LossSpec, SamplerHandle, SamplingParams
from headrace.renderers import renderer_for
from headrace.run.config import RunConfig

from .config import SDFTConfig
from .data import Messages, conversation, train_and_test
from .loop import Session, session
from .render import render, to_datum
from .sft import nll
from .steps import run_steps, schedule

log = logs.get_logger()


def teacher_messages(prompt: Messages, demonstration: str, template: str) -> Messages:
    """The prompt with the demonstration in its last user turn (a new user turn when there is none)."""
    last = max((i for i, m in enumerate(prompt) if m["role"] == "user"), default=None)
    if last is None:
        return [*prompt, {"role": "user", "content": template.format(prompt="", demonstration=demonstration)}]
    text = template.format(prompt=prompt[last]["content"], demonstration=demonstration)
    return [*prompt[:last], {"role": "user", "content": text}, *prompt[last + 1 :]]


def topk_datums(
    prompt: list[int], sampled: list[int], top: list[list[tuple[int, float]]], scale: float
) -> tuple[list[Datum], float]:
    """k datums whose targets at the sampled positions are the teacher's k tokens, weighted by
    their renormalised probabilities x ``scale``; and the teacher's mean entropy over them."""
    tokens = [*prompt, *sampled]
    k = min(len(row) for row in top) if top else 0
    start = len(prompt) - 1  # datum position start + j predicts sampled[j]
    targets = [list(tokens[1:]) for _ in range(k)]
    weights = [[0.0] * (len(tokens) - 1) for _ in range(k)]
    entropy = 0.0
    for j, row in enumerate(top):
        row = row[:k]
        peak = max(lp for _, lp in row)
        z = sum(math.exp(lp - peak) for _, lp in row)
        for m, (token, lp) in enumerate(row):
            q = math.exp(lp - peak) / z
            targets[m][start + j] = token
            weights[m][start + j] = q * scale
            entropy -= q * math.log(q) if q > 0 else 0.0
    zeros = [0.0] * (len(tokens) - 1)
    datums = [Datum(tokens[:-1], targets[m], zeros, zeros, weights[m]) for m in range(k)]
    return datums, entropy / max(len(top), 1)


async def sdft(config: RunConfig, view: Any = None) -> Session:
    opts: SDFTConfig = config.section("sdft")
    train_records, test_records = train_and_test(
        "headrace sdft",
        "conversations; the demonstration is the assistant turn",
        opts.data,
        opts.test_data,
        opts.test_fraction,
        config.seed,
    )
    async with session(config, view) as s:
        sampling, training, tok = s.backend.sampling, s.backend.training, s.backend.tokenizer
        if not isinstance(sampling, ScoresTopK):
            raise ConfigError(
                f"headrace sdft needs a sampler that gives each position's top-k logprobs (ScoresTopK); "
                f"'{config.backend}' has none. Use torch or tinker."
            )
        renderer: Any = renderer_for(config.model, tok, config.renderer)
        examples: list[tuple[list[int], list[int]]] = []  # (the student's prompt, the teacher's)
        for i, record in enumerate(train_records):
            messages = conversation(record, f"--data {opts.data} example {i}")
            if messages[-1]["role"] != "assistant":
                raise ConfigError(f"--data {opts.data} example {i}: the last turn must be the demonstration")
            prompt, demo = messages[:-1], messages[-1]["content"]
            examples.append(
                (
                    renderer.build_generation_prompt(prompt),
                    renderer.build_generation_prompt(teacher_messages(prompt, demo, opts.teacher_template)),
                )
            )
        test = []
        for i, record in enumerate(test_records[: opts.max_test]):
            tokens, weights = render(renderer, tok, conversation(record, f"held-out example {i}"))
            test.append(to_datum(tokens, weights, opts.max_length))
        sizes = [len(teacher) for _, teacher in examples]
        plan = schedule(sizes, opts.batch_tokens, opts.epochs, config.steps, config.seed)
        per_epoch = len(schedule(sizes, opts.batch_tokens, 1.0, 10**9, config.seed))
        s_cfg = config.sampling
        params = SamplingParams(
            max_tokens=s_cfg.max_tokens,
            temperature=s_cfg.temperature,
            top_p=s_cfg.top_p,
            top_k=s_cfg.top_k,
            stop_token_ids=tuple(renderer.stop_token_ids),
        )
        log.info("sdft_data", train=len(examples), test=len(test), steps=len(plan))

        synced: list[SamplerHandle] = []  # sdft.teacher_sync_every > 0: the teacher's weights, the last taken

        async def step(k: int) -> dict[str, Any]:
            handle = await training.publish(k)  # the student samples these weights
            every = opts.teacher_sync_every
            if not every:
                teacher_weights = s.backend.initial_handle()
            else:
                if not synced or k % every == 0:
                    synced[:] = [handle]
                teacher_weights = synced[0]
            rollouts = []
            for n, i in enumerate(plan[k]):
                student, teacher = examples[i]
                seeded = SamplingParams(**{**params.__dict__, "seed": (config.seed * 1_000_003 + k) * 4096 + n})
                for sample in await sampling.sample(handle, student, opts.samples, seeded):
                    if not sample.tokens:
                        continue
                    top = await sampling.topk_logprobs(teacher_weights, [*teacher, *sample.tokens], opts.top_k)
                    rollouts.append((student, sample.tokens, top[len(teacher) :]))
            positions = sum(len(sampled) for _, sampled, _ in rollouts)
            if not positions:
                return {"sdft/sample_tokens": 0.0, "sdft/epoch": (k + 1) / per_epoch}
            datums, entropies = [], []
            for student, sampled, top in rollouts:
                made, entropy = topk_datums(student, sampled, top, 1.0 / positions)
                datums += made
                entropies.append(entropy)
            fb = training.forward_backward(datums, LossSpec("cross_entropy"))
            opt = training.optim_step(s.adam)
            out, optim = await fb, await opt
            total, weight = nll(datums, out.logprobs_D)
            return {
                "sdft/topk_ce": total / weight,  # Σ q log(1/π_student) over the teacher's top k, a position's mean
                "sdft/teacher_entropy": sum(entropies) / len(entropies),
                "sdft/sample_tokens": float(positions),
                "sdft/teacher_version": float(teacher_weights.version),
                "sdft/epoch": (k + 1) / per_epoch,
                **optim.metrics,
            }

        async def evaluate(trained: int) -> dict[str, float]:
            figures: dict[str, float] = {}
            if test:
                total, w = nll(test, await s.forward(test))
                figures["test/nll"] = total / w  # the held-out demonstrations' loss, as headrace sft reports it
            return figures | await s.env_figures(opts.env, trained, len(plan))

        await run_steps(s, len(plan), step, evaluate, opts.eval_every)
        return s
