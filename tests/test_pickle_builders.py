"""Every built-in env's group builders survive a pickle round trip (issue 14 ships them to other
processes): the clone makes envs with the same prompts as the original. A new built-in env without
a case here fails the coverage test."""

from __future__ import annotations

import json
import pickle

import pytest

from headrace.envs.context import EnvContext
from headrace.plugins import registry
from headrace.tokenizers.char import CharTokenizer

pytestmark = pytest.mark.timeout(60)

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "Ann has 9 cards and gives 4 away.", "answer": "9 - 4 = 5\n#### 5"},
]
MATH_ROWS = [{"problem": "What is 2+2?", "solution": "\\boxed{4}"}, {"problem": "1+2?", "solution": "\\boxed{3}"}]
OPTIONS = {  # env -> its options ({path} is a small JSONL file the test writes)
    "arithmetic": {},
    "guess_number": {},
    "faulty": {"fail_rate": 0.5},
    "flaky_arithmetic": {},
    "word_math": {"difficulty": 1},
    "tictactoe": {},
    "tool_calc": {},
    "pairwise_judge": {"judge": "shorter"},
    "gsm8k": {"path": "{path}"},
    "math": {"path": "{path}"},
}


# the ecosystem's envs need a server or a package: tests/test_ecosystem_*.py pickle theirs
ECOSYSTEM = {"openenv", "verifiers"}


def test_every_built_in_env_has_a_case():
    built_in = {name for name in registry.envs.names() if registry.envs.get(name).__module__.startswith("headrace.")}
    assert built_in - ECOSYSTEM == set(OPTIONS)


@pytest.mark.parametrize("env", sorted(OPTIONS))
async def test_builders_survive_a_pickle_round_trip(tmp_path, env):
    path = tmp_path / f"{env}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in (MATH_ROWS if env == "math" else GSM8K_ROWS)))
    options = {key: value.format(path=path) if isinstance(value, str) else value for key, value in OPTIONS[env].items()}
    ctx = EnvContext(
        tokenizer=CharTokenizer(), group_size=4, batch_size=2, steps=2, seed=0, max_tokens=32, options=options
    )
    dataset = registry.envs.get(env)(ctx)
    builders = [builder for index in range(len(dataset)) for builder in dataset.get_batch(index)]
    assert builders
    for builder in builders:
        clone = pickle.loads(pickle.dumps(builder))
        assert type(clone) is type(builder) and clone is not builder
        envs, again = await builder.make_envs(), await clone.make_envs()
        assert len(envs) == len(again) > 0
        assert [(await e.initial_observation())[0] for e in envs] == [(await e.initial_observation())[0] for e in again]
        assert clone.logging_tags() == builder.logging_tags()
