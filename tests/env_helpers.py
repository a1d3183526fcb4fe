"""Driving envs by hand: scripted replies as token ids, as a sampler would return them."""

from __future__ import annotations

import json
from typing import Any

from headrace.core.types import SampledTokens, StepResult, StopReason
from headrace.renderers import get_renderer
from headrace.run.config import build_config
from headrace.tokenizers.char import CharTokenizer


def tiny_renderer():
    return get_renderer("tiny", CharTokenizer())


def chatml_renderer():
    from tests.test_renderers import chatml_tokenizer  # a byte-level tokenizer with ChatML, built in a second

    return get_renderer("chat_template", chatml_tokenizer())


def encode(renderer, text: str) -> list[int]:
    hf = getattr(renderer, "hf", None)
    return list(hf.encode(text, add_special_tokens=False)) if hf is not None else renderer.tok.encode(text)


def action(renderer, text: str, close: bool = True) -> SampledTokens:
    """``text`` as sampled tokens; ``close=False``: cut off by max_tokens before the end of turn."""
    tokens = encode(renderer, text) + (list(renderer.end_of_turn) if close else [])
    return SampledTokens(tokens, [-1.0] * len(tokens), StopReason.STOP if close else StopReason.LENGTH)


async def drive(env, renderer, replies: list[str]) -> tuple[list[list[int]], list[SampledTokens], list[StepResult]]:
    """Play ``replies`` until the env says done: the observations, the actions and the results."""
    observation, _ = await env.initial_observation()
    observations, actions, results = [observation], [], []
    for reply in replies:
        actions.append(action(renderer, reply))
        results.append(await env.step(actions[-1]))
        if results[-1].done:
            break
        observations.append(results[-1].next_observation)
    return observations, actions, results


def run_config(tmp_path, env: str, backend: str = "sim", options: dict[str, Any] | None = None, **flags: Any):
    """A 2-step run of ``env`` with a tiny batch; constant-reward groups still train (the sim's
    and the untrained tiny model's answers are mostly wrong, so many groups are constant)."""
    flags = {"run_dir": str(tmp_path / "run"), "progress": False, "seed": 0, "steps": 2, **flags}
    overrides = [f"backend={backend}", f"env={env}", "batch_size=2", "group_size=4", "advantages.filter_constant=false"]
    if backend == "torch":
        overrides += ["model=tiny", "torch.device=cpu"]
    if options:
        overrides.append("env_options={" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items()) + "}")
    return build_config(flags=flags, overrides=overrides)
