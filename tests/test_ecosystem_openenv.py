"""The ``openenv`` env against a real OpenEnv server on loopback (``tests/openenv_guess.py``, served
by openenv-core's own ``create_fastapi_app`` and uvicorn): episodes driven by hand through
openenv-core's client, then ``headrace run --env openenv`` in a subprocess on sim and on the
torch backend with the embedded tiny model."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# present, not imported: importing openenv.core takes 6-8 s, which every pytest process (each xdist
# worker, the serial phase) paid at collection; a test imports it where it needs it
if importlib.util.find_spec("openenv") is None:
    pytest.skip("openenv-core is not installed (scripts/setup.sh VENV ecosystem)", allow_module_level=True)

from headrace.core.types import SampledTokens, StopReason  # noqa: E402
from headrace.ecosystem import openenv_env  # noqa: E402
from headrace.ecosystem.openenv_env import (  # noqa: E402
    FieldAction,
    InvalidAction,
    JsonAction,
    ObservationText,
    OpenEnvEnv,
    OpenEnvSpec,
    action_from_schema,
    generic_client,
    held_out_seeds,
)
from headrace.envs.context import EnvContext  # noqa: E402
from headrace.renderers.plain_text import PlainText  # noqa: E402
from headrace.tokenizers.char import CharTokenizer  # noqa: E402
from tests.helpers import run_argv, run_sim  # noqa: E402

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def serve(kind: str, logs: Path) -> Iterator[str]:
    """``tests/openenv_guess.py KIND`` in a process of its own; its URL while the fixture lasts.
    Its log goes to a file: a pipe nobody reads would fill and stall the server."""
    log = logs / f"openenv_{kind}.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(
            [sys.executable, str(TESTS / "openenv_guess.py"), kind], stdout=subprocess.PIPE, stderr=sink, text=True
        )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("PORT "), f"the server did not start: {line!r} {log.read_text()}"
        url = f"http://127.0.0.1:{line.split()[1]}"
        for _ in range(600):  # the port is bound before uvicorn serves: wait until it answers
            try:
                openenv_env.fetch_schema(url, timeout_s=1.0)
                break
            except ValueError:
                assert process.poll() is None, f"the server exited: {log.read_text()}"
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def text_server(tmp_path_factory) -> Iterator[str]:
    yield from serve("text", tmp_path_factory.mktemp("servers"))


@pytest.fixture(scope="module")
def number_server(tmp_path_factory) -> Iterator[str]:
    yield from serve("number", tmp_path_factory.mktemp("servers"))


RENDERER = PlainText(CharTokenizer())


def reply(text: str) -> SampledTokens:
    tokens = [*RENDERER.tok.encode(text), RENDERER.tok.eos_token_id]
    return SampledTokens(tokens, [-1.0] * len(tokens), StopReason.STOP)


def spec(url: str, **changes) -> OpenEnvSpec:
    to_action = action_from_schema(openenv_env.fetch_schema(url)["action"])
    return OpenEnvSpec(url, generic_client(), to_action, ObservationText(), **changes)


def test_the_action_schema_decides_how_a_reply_becomes_an_action():
    one_text = {"properties": {"metadata": {"type": "object"}, "message": {"type": "string"}}}
    assert action_from_schema(one_text)("hi there") == {"message": "hi there"}
    one_int = {"properties": {"guess": {"type": "integer"}}}
    assert action_from_schema(one_int)("i say 7, or 8") == {"guess": 7}
    with pytest.raises(InvalidAction, match="no number"):
        action_from_schema(one_int)("seven")
    optional = {"properties": {"x": {"anyOf": [{"type": "number"}, {"type": "null"}]}}}
    assert action_from_schema(optional)("x=2.5") == {"x": 2.5}
    several = {"properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
    assert isinstance(action_from_schema(several), JsonAction)
    assert action_from_schema(several)('{"a": "x", "b": 2}') == {"a": "x", "b": 2}
    with pytest.raises(InvalidAction):
        action_from_schema(several)("a=x b=2")
    one_required = {"properties": {"code": {"type": "string"}, "timeout": {"type": "number"}}, "required": ["code"]}
    assert action_from_schema(one_required) == FieldAction("code", "string")
    assert action_from_schema(several, "a")("free text") == {"a": "free text"}
    with pytest.raises(ValueError, match="no field 'c'"):
        action_from_schema(several, "c")


def test_an_observation_becomes_the_text_of_a_message():
    text = ObservationText()
    assert text({"prompt": "guess:", "guesses": 1}) == "guess:"
    assert text({"echoed_message": "hello", "message_length": 5}) == "hello"  # its only text
    assert json.loads(text({"board": [1, 2], "turn": 3})) == {"board": [1, 2], "turn": 3}
    assert ObservationText("board")({"board": [1, 2], "prompt": "x"}) == "[1, 2]"
    with pytest.raises(KeyError, match="no field 'nope'"):
        ObservationText("nope")({"prompt": "x"})


@pytest.mark.slow  # > 10 s (a server, a subprocess or a benchmark); CI runs it
async def test_an_episode_plays_a_session_on_the_server(text_server):
    secret = random.Random(5).randint(0, 9)
    wrong = (secret + 1) % 10
    env = OpenEnvEnv(spec(text_server), 5, RENDERER, 8)
    observation, _ = await env.initial_observation()
    assert RENDERER.tok.decode(observation) == "guess 0-9:"  # reset's observation, as the prompt
    first = await env.step(reply(str(wrong)))
    assert not first.done and first.reward == 0.0
    hint = " higher:" if wrong < secret else " lower:"
    assert RENDERER.tok.decode(first.next_observation).endswith(hint)  # the next observation, token in / token out
    assert first.next_observation[: len(observation)] == observation
    last = await env.step(reply(str(secret)))
    assert last.done and last.reward == 1.0
    # the server's state, reported when the episode ends: it played the seed's secret
    assert last.metrics["state/secret"] == secret and last.metrics["state/step_count"] == 2
    assert last.metrics["invalid_action"] == 0.0 and env.client is None  # the session is closed


@pytest.mark.slow  # > 10 s (a server, a subprocess or a benchmark); CI runs it
async def test_a_reply_that_makes_no_action_ends_the_episode(number_server, text_server):
    env = OpenEnvEnv(spec(number_server, invalid_action_reward=-0.5), 1, RENDERER, 8)
    await env.initial_observation()
    result = await env.step(reply("no idea"))  # no number for the integer field
    assert result.done and result.reward == -0.5 and result.metrics["invalid_action"] == 1.0
    # the server refusing an action (its validation error) counts the same
    refused = OpenEnvEnv(spec(text_server, invalid_action_reward=-0.5), 1, RENDERER, 8)
    refused.spec = OpenEnvSpec(text_server, generic_client(), lambda text: {"guess": [text]}, ObservationText())
    await refused.initial_observation()
    result = await refused.step(reply("3"))
    assert result.done and result.metrics["invalid_action"] == 1.0 and refused.client is None


async def test_a_number_field_takes_the_reply_s_first_number(number_server):
    secret = random.Random(9).randint(0, 9)
    env = OpenEnvEnv(spec(number_server), 9, RENDERER, 8)
    await env.initial_observation()
    result = await env.step(reply(f"it is {secret}!"))
    assert result.done and result.reward == 1.0


async def test_a_full_server_is_said_in_one_paragraph():
    env = OpenEnvEnv(OpenEnvSpec("http://h:1", generic_client(), FieldAction("x"), ObservationText()), 0, RENDERER, 8)

    async def refused():
        raise RuntimeError("Server error: Server at capacity (1/1 sessions) (code: CAPACITY_REACHED)")

    with pytest.raises(RuntimeError, match="max_concurrent_envs=N"):
        await env._call(refused())


async def test_cleanup_closes_a_session_an_episode_left_open(text_server):
    group = openenv_env.OpenEnvGroup(spec(text_server), 3, 2, RENDERER, 8)
    envs = await group.make_envs()
    for env in envs:
        await env.initial_observation()
    assert all(env.client is not None for env in envs)
    await group.cleanup()  # the rollout actor's, when the group failed or was cancelled mid-episode
    assert all(env.client is None for env in envs)


async def test_a_group_survives_a_pickle_round_trip_without_its_sessions(text_server):
    group = openenv_env.OpenEnvGroup(spec(text_server), 3, 2, RENDERER, 8)
    await (await group.make_envs())[0].initial_observation()
    clone = pickle.loads(pickle.dumps(group))  # --cluster ray ships builders to its workers
    assert clone.made == [] and clone.seed == 3
    prompts = [(await env.initial_observation())[0] for env in await clone.make_envs()]
    assert prompts == [RENDERER.tok.encode("guess 0-9:")] * 2
    await clone.cleanup()
    await group.cleanup()


def test_a_dataset_s_groups_share_a_seed_and_the_test_split_is_held_out(text_server):
    ctx = EnvContext(CharTokenizer(), group_size=3, batch_size=4, steps=5, seed=1, max_tokens=8)
    train = openenv_env.openenv_dataset(ctx, text_server)
    seeds = [group.seed for i in range(len(train)) for group in train.get_batch(i)]
    assert len(set(seeds)) == len(seeds) == 20 and all(g.group_size == 3 for g in train.get_batch(0))
    held_out = set(held_out_seeds(200))
    assert not held_out & set(seeds)
    test = openenv_env.openenv_dataset(ctx, text_server, split="test", eval_size=6)
    assert [g.seed for i in range(len(test)) for g in test.get_batch(i)] == held_out_seeds(6)


def guess_of(text: str) -> dict:
    """A user's reply -> action function: the last digit of the reply, 0 when it has none."""
    digits = [c for c in text if c.isdigit()]
    return {"guess": int(digits[-1]) if digits else 0}


async def test_the_python_form_takes_the_user_s_functions(tmp_path, number_server):
    ctx = EnvContext(CharTokenizer(), group_size=4, batch_size=2, steps=2, seed=0, max_tokens=8)
    dataset = openenv_env.openenv_dataset(
        ctx, number_server, to_action=guess_of, to_text=lambda obs: obs["prompt"].upper(), max_turns=2
    )
    summary = await run_sim(tmp_path, dataset=dataset, steps=2, batch_size=2, group_size=4)
    assert summary.steps == 2 and all(row.get("groups/dropped", 0) == 0 for row in summary.metrics)
    # every reply made an action (guess_of never refuses), and no episode took more than its 2 turns
    assert all(row["env/openenv/invalid_action"] == 0.0 for row in summary.metrics)
    assert all(1 <= row["env/openenv/state/step_count"] <= 2 for row in summary.metrics)


def headrace(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "headrace", *argv], capture_output=True, text=True, timeout=280, cwd=cwd, env=env
    )


def states(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [line for line in lines if line.get("event") == "openenv_state"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sim", "torch"])
def test_headrace_run_trains_on_an_openenv_server(tmp_path, text_server, backend):
    run_dir = tmp_path / backend
    options = {"env_options.url": text_server, "advantages.filter_constant": "false"}
    if backend == "torch":
        options["model"] = "tiny"
    # evaluation on held-out seeds at the start and the end (eval.env_options' split=test)
    options |= {"eval.every": 2, "eval.problems": 2, "eval.samples": 1}
    out = headrace(*run_argv(env="openenv", backend=backend, steps=2, run_dir=run_dir, set=options))
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["optim/datums"] == 8 for row in rows)  # 2 groups of 4 a step
    assert all(row["env/openenv/state/step_count"] >= 1 for row in rows)
    played = states(run_dir)
    # every episode ended with the server's state logged; a seed's secret is the one the server drew from it
    assert all(s["state"]["secret"] == random.Random(s["seed"]).randint(0, 9) for s in played)
    trained = [s["seed"] for s in played if s["seed"] not in held_out_seeds(2)]
    evaluated = [s["seed"] for s in played if s["seed"] in held_out_seeds(2)]
    assert len(trained) == 16 and {trained.count(seed) for seed in trained} == {4}  # 4 groups, G=4 each
    assert len(evaluated) >= 2 * 2  # two evaluations of the 2 held-out problems


@pytest.mark.slow
def test_a_wrong_or_missing_url_is_a_usage_error(tmp_path):
    out = headrace(*run_argv(env="openenv", run_dir=tmp_path / "a"))
    assert out.returncode == 2 and "env_options.url=http://HOST:PORT" in out.stderr
    out = headrace(*run_argv(env="openenv", run_dir=tmp_path / "b", set={"env_options.url": "http://127.0.0.1:9"}))
    assert out.returncode == 2 and "cannot read the OpenEnv server's action schema" in out.stderr, out.stderr
