"""What ``arithmetic`` and ``guess_number`` give on the embedded tiny model, through the engine's
``Env`` API only (prompts, stop conditions, rewards, next observations), so the record is the same
whatever the envs are written on. ``tests/golden_envs_tiny.json`` is this, captured from the
token-level envs before their rewrite on the message bases; ``tests/test_envs_arithmetic_guess.py``
checks the envs still give exactly it. Regenerate only for a change meant to alter the tiny
model's prompts or rewards (benchmarks, the sim and the recorded learning figures depend on them):
``.venv/bin/python -m tests.golden_envs_tiny > tests/golden_envs_tiny.json``.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

from headrace.backends.sim import VERSION_BASE
from headrace.core.types import SampledTokens, StopReason
from headrace.envs.context import EnvContext
from headrace.plugins import registry
from headrace.run.config import build_config
from headrace.run.train import train
from headrace.tokenizers.char import CharTokenizer

TOK = CharTokenizer()
EOS = TOK.eos_token_id
STAMP = VERSION_BASE + 3  # the sim's version stamp: an id outside the vocabulary, kept as sampled
SEEDS = (0, 1, 2)
# the metrics the token-level envs reported (the rewrite may report more)
METRICS = {"arithmetic": ("correct", "exact"), "guess_number": ("solved", "guesses")}


def act(text: str, *, close: bool = True, stamp: bool = False) -> list[int]:
    return [STAMP] * stamp + TOK.encode(text) + [EOS] * close


ARITHMETIC_ACTIONS = [
    *(act(str(n)) for n in range(10)),
    act(" 4 "),  # spaces around: right and exact when 4 is the sum
    act("4x"),  # words after: right, not exact
    act("14"),
    act("-4"),
    act("4", close=False),  # cut off by max_tokens before EOS
    act("4", stamp=True),
    act(""),  # EOS alone
    act("x"),
]
GUESS_SCRIPTS = [
    [act("0"), act("1"), act("2"), act("3")],
    [act("9"), act("5"), act("7"), act("4")],
    [act("5", close=False), act("x"), act(" 8 "), act("6", stamp=True)],
    [act(""), act("4", stamp=True), act("2"), act("1")],
]


def context(seed: int, options: dict[str, Any] | None = None) -> EnvContext:
    return EnvContext(
        tokenizer=TOK, group_size=2, batch_size=4, steps=3, seed=seed, max_tokens=4, options=options or {}
    )


def sampled(tokens: list[int]) -> SampledTokens:
    stop = StopReason.STOP if tokens and tokens[-1] == EOS else StopReason.LENGTH
    return SampledTokens(tokens, [-1.0] * len(tokens), stop)


def stop_of(stop) -> list[Any]:
    return [stop.max_tokens, list(stop.stop_token_ids)]


def result_of(env_name: str, result) -> list[Any]:
    """[reward, done, then the metrics in ``METRICS`` order]"""
    return [result.reward, result.done, *(result.metrics.get(k) for k in METRICS[env_name])]


async def arithmetic_record(options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    record = []
    for seed in SEEDS:
        dataset = registry.envs.get("arithmetic")(context(seed, options))
        for batch in (0, 1):
            for builder in dataset.get_batch(batch):
                envs = await builder.make_envs()
                prompt, stop = await envs[0].initial_observation()
                rewards = []
                for tokens in ARITHMETIC_ACTIONS:
                    env = (await builder.make_envs())[0]
                    await env.initial_observation()
                    rewards.append(result_of("arithmetic", await env.step(sampled(tokens))))
                entry = {"seed": seed, "batch": batch, "prompt": prompt, "stop": stop_of(stop)}
                record.append({**entry, "tags": builder.logging_tags(), "group": len(envs), "results": rewards})
    return record


async def guess_number_record(options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    record = []
    for seed in SEEDS:
        dataset = registry.envs.get("guess_number")(context(seed, options))
        for builder in dataset.get_batch(0):
            for script in GUESS_SCRIPTS:
                env = (await builder.make_envs())[0]
                observation, stop = await env.initial_observation()
                turns = [{"observation": observation, "stop": stop_of(stop)}]
                for tokens in script:
                    result = await env.step(sampled(tokens))
                    turn: dict[str, Any] = {"result": result_of("guess_number", result)}
                    if not result.done:
                        turn |= {"observation": result.next_observation, "stop": stop_of(result.next_stop)}
                    turns.append(turn)
                    if result.done:
                        break
                record.append({"seed": seed, "tags": builder.logging_tags(), "turns": turns})
    return record


async def sim_rows(env: str, run_dir: Path) -> list[dict[str, float]]:
    """A short sync run on the sim: its samples are seeded by the prompt tokens, so any change to a
    prompt or a reward shows in these rows."""
    flags = {"run_dir": str(run_dir), "progress": False, "seed": 0, "steps": 3}
    overrides = ["backend=sim", "scheduler=sync", f"env={env}", "batch_size=4", "group_size=4"]
    overrides.append("advantages.filter_constant=false")
    summary = await train(build_config(flags=flags, overrides=overrides))
    keys = ["reward/mean", *(f"env/{env}/{name}" for name in METRICS[env])]
    return [{k: row[k] for k in keys} for row in summary.metrics]


async def env_records() -> dict[str, Any]:
    return {
        "arithmetic": await arithmetic_record(),
        "arithmetic ops=+-* max_operand=9": await arithmetic_record({"ops": "+-*", "max_operand": 9}),
        "guess_number": await guess_number_record(),
        "guess_number max_number=20 max_guesses=3": await guess_number_record({"max_number": 20, "max_guesses": 3}),
    }


async def sim_records(tmp: Path) -> dict[str, Any]:
    return {
        "sim arithmetic": await sim_rows("arithmetic", tmp / "arithmetic"),
        "sim guess_number": await sim_rows("guess_number", tmp / "guess_number"),
    }


async def capture(tmp: Path) -> dict[str, Any]:
    return await env_records() | await sim_records(tmp)


def dumps(record: dict[str, Any]) -> str:
    """One line an entry, so a diff shows which prompt or reward moved."""
    parts = [
        json.dumps(key) + ": [\n" + ",\n".join(json.dumps(entry, separators=(",", ":")) for entry in entries) + "\n]"
        for key, entries in record.items()
    ]
    return "{\n" + ",\n".join(parts) + "\n}\n"


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print(dumps(asyncio.run(capture(Path(tmp)))), end="")
