"""The ``verifiers`` env: verifiers environments (``verifiers.v1``) written locally as a user writes
one (``tests/verifiers_envs``: a single-turn taskset and a multi-turn one with an MCP tool), their
own rollouts (verifiers' chat loop in a process of its own, its interception server, the tool
server, the rubric) run against the agents' endpoint. Driven in-process with a scripted model
(what each call samples chosen by the test), then through ``headrace run`` in a subprocess on sim
and on the torch backend with the embedded tiny model."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# present, not imported: importing verifiers.v1 takes 6-8 s, which every pytest process (each xdist
# worker, the serial phase) paid at collection; a test imports it where it needs it
if importlib.util.find_spec("verifiers.v1") is None:
    pytest.skip("verifiers 0.4 is not installed (scripts/setup.sh VENV ecosystem)", allow_module_level=True)

from headrace.agents.endpoint import AgentEndpoint  # noqa: E402
from headrace.agents.env import AgentEnv  # noqa: E402
from headrace.core.episode import EpisodeSpec, run_episode  # noqa: E402
from headrace.core.types import SampledTokens, SamplingParams, StopReason  # noqa: E402
from headrace.ecosystem import verifiers_env  # noqa: E402
from headrace.ecosystem.verifiers_env import VerifiersEpisodeError  # noqa: E402
from headrace.envs.context import EnvContext  # noqa: E402
from headrace.renderers import renderer_for  # noqa: E402
from headrace.tokenizers.char import CharTokenizer  # noqa: E402
from tests.helpers import run_argv  # noqa: E402

pytestmark = pytest.mark.timeout(300)

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ENVS = TESTS / "verifiers_envs"
TOK = CharTokenizer()
SPEC = EpisodeSpec(SamplingParams(max_tokens=32), max_turns=8, seed=0, vocab_size=TOK.vocab_size)


@pytest.fixture(autouse=True)
def environments_on_the_path(monkeypatch):
    """The test environments importable here and in the processes verifiers starts (the tool server)."""
    monkeypatch.syspath_prepend(str(ENVS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ENVS), os.environ.get("PYTHONPATH", "")]))


def context(**options) -> EnvContext:
    return EnvContext(TOK, group_size=2, batch_size=2, steps=2, seed=0, max_tokens=32, options=options)


class Model:
    """A scripted model on the tiny alphabet: ``add A and B`` -> a call of the calculator; after its
    result (a ``tool`` turn, ``t:``) -> that result; ``A+B=`` -> the sum, or ``wrong``."""

    def __init__(self, wrong: bool = False):
        self.wrong, self.prompts = wrong, []

    async def __call__(self, prompt, n, params):
        text = TOK.decode(prompt)
        self.prompts.append(text)
        if result := re.search(r"t:(\d+)a:$", text):
            reply = result.group(1)
        elif numbers := re.search(r"add (\d+) and (\d+)a:$", text):
            reply = f"<call>calcadd(a={numbers.group(1)},b={numbers.group(2)})</call>"
        else:
            a, b = map(int, re.findall(r"(\d+)\+(\d+)=", text)[-1])
            reply = "99" if self.wrong else str(a + b)
        tokens = [*TOK.encode(reply), TOK.eos_token_id]
        return [SampledTokens(tokens, [-0.5] * len(tokens), StopReason.STOP, 0)] * n


async def play(dataset, model: Model, served: bool = True):
    """The first group's first episode, through the endpoint; ``served``: the environment served as
    a run serves it (else the episode serves it for its own length)."""
    endpoint = AgentEndpoint(renderer_for("tiny", TOK), TOK, 32, "tiny")
    builder = dataset.get_batch(0)[0]
    episode = AgentEnv(builder.agent, builder.problem, endpoint)
    if not served:
        return builder.problem, await run_episode(episode, model, SPEC, seed=1)
    async with dataset.lifespan():
        trajectory = await run_episode(episode, model, SPEC, seed=1)
        server = dataset.environment.env._interception
        assert server.clients == {}  # the episode's model client was taken out after it (no client kept per episode)
    return builder.problem, trajectory


@pytest.mark.slow  # > 10 s (a server, a subprocess or a benchmark); CI runs it
async def test_a_single_turn_environment_is_rewarded_by_its_own_rubric():
    dataset = verifiers_env.verifiers_dataset(context(), "hr-vf-sum", harness="null")
    task, right = await play(dataset, Model())
    assert len(right.transitions) == 1 and right.total_reward == 1.0
    metrics = right.transitions[-1].metrics
    assert metrics["verifiers/reward/correct"] == 1.0 and metrics["verifiers/turns"] == 1.0
    assert metrics["verifiers/length"] == len(task.data.answer)  # its @vf.metric
    assert metrics["agent/calls_per_episode"] == 1.0
    assert TOK.decode(right.transitions[0].observation) == f"u:{task.data.prompt}a:"  # the task's prompt, rendered
    _, wrong = await play(dataset, Model(wrong=True), served=False)  # outside a run: served for the episode
    assert wrong.total_reward == 0.0 and wrong.transitions[-1].metrics["verifiers/reward/correct"] == 0.0


@pytest.mark.slow  # > 10 s (a server, a subprocess or a benchmark); CI runs it
async def test_a_multi_turn_tool_environment_runs_its_tool_and_its_stops():
    dataset = verifiers_env.verifiers_dataset(context(), "hr-vf-calc", harness="null")
    model = Model()
    task, trajectory = await play(dataset, model)
    a, b = map(int, re.findall(r"\d+", task.data.prompt))
    assert "tools: calcadd(a,b) add two numbers" in model.prompts[0]  # the MCP server's tool, offered
    assert len(trajectory.transitions) == 2 and trajectory.total_reward == 1.0
    assert TOK.decode(trajectory.transitions[1].observation).endswith(f"t:{a + b}a:")  # the tool server's answer
    metrics = trajectory.transitions[-1].metrics
    assert metrics["verifiers/called"] == 1.0 and metrics["agent/tool_calls"] == 1.0
    # verifiers' chat loop sends the history back as it was: one training sequence, token in / token out
    assert metrics["agent/prefix_extension_rate"] == 1.0 and metrics["agent/sequences"] == 1.0


async def test_an_episode_verifiers_reports_failed_raises_with_its_errors():
    dataset = verifiers_env.verifiers_dataset(context(), "hr-vf-sum", harness="null", taskset={"fail": True})
    with pytest.raises(VerifiersEpisodeError, match="the rubric broke"):
        await play(dataset, Model(), served=False)


def test_the_held_out_split():
    def prompts(**options) -> list[str]:
        dataset = verifiers_env.verifiers_dataset(context(), **options)
        return [b.problem.data.prompt for i in range(len(dataset)) for b in dataset.get_batch(i)]

    # a taskset with a split of its own gets it
    assert set(prompts(env_id="hr-vf-sum")) <= {f"{a}+{b}=" for a in range(7) for b in range(6)}
    assert set(prompts(env_id="hr-vf-sum", split="test")) <= {"6+4=", "6+5="} | {f"7+{b}=" for b in range(6)}
    # one without: a tenth held out by a hash of the task's data, the rest trained on
    every = {f"add {a} and {b}" for a in range(10, 40, 3) for b in range(5, 9)}
    train, test = set(prompts(env_id="hr-vf-calc")), set(prompts(env_id="hr-vf-calc", split="test"))
    assert train and test and not train & test and train | test <= every
    # eval_taskset names the held-out tasks outright
    assert set(prompts(env_id="hr-vf-sum", split="test", eval_taskset={"split": "train"})) <= {
        f"{a}+{b}=" for a in range(7) for b in range(6)
    }


def test_a_wrong_id_or_option_is_said_in_one_paragraph():
    with pytest.raises(ValueError, match="'no-such-env' is not installed.*pip install"):
        verifiers_env.verifiers_dataset(context(), "no-such-env")
    with pytest.raises(ValueError, match="has no option 'harnes'.*did you mean 'harness'"):
        verifiers_env.make_dataset(context(id="hr-vf-sum", harnes="null"))
    with pytest.raises(ValueError, match="env_options.id=ENV_ID"):
        verifiers_env.make_dataset(context())


def test_the_chat_program_runs_with_this_python_when_uv_is_missing():
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    verifiers_env.use_this_python_for_the_chat_program()
    prepared = {
        p: i for p, i in SubprocessRuntime._interpreters.items() if Path(p).read_bytes() == CHAT_PROGRAM_SOURCE.encode()
    }
    assert list(prepared.values()) == [sys.executable]


def headrace(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ENVS)])}
    return subprocess.run(
        [sys.executable, "-m", "headrace", *argv], capture_output=True, text=True, timeout=280, cwd=ROOT, env=env
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "env_id"),
    [("sim", "hr-vf-sum"), ("sim", "hr-vf-calc"), ("torch", "hr-vf-sum"), ("torch", "hr-vf-calc")],
)
def test_headrace_run_trains_on_a_verifiers_environment(tmp_path, backend, env_id):
    run_dir = tmp_path / "run"
    settings = {"env_options.id": env_id, "env_options.harness": "null", "advantages.filter_constant": "false"}
    if backend == "torch":
        settings["model"] = "tiny"
    if env_id == "hr-vf-sum":  # and an evaluation on its held-out split, at the start and the end
        settings |= {"eval.every": 2, "eval.problems": 2, "eval.samples": 1}
    argv = run_argv(
        env="verifiers", backend=backend, steps=2, batch_size=1, group_size=2, run_dir=run_dir, set=settings
    )
    out = headrace(*argv)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["optim/datums"] == 2 for row in rows)
    for row in rows:  # every episode was verifiers' own: its rubric, its turns, its calls on the endpoint
        assert row[f"env/{env_id}/verifiers/turns"] >= 1 and row[f"env/{env_id}/agent/calls_per_episode"] >= 1
        assert f"env/{env_id}/verifiers/reward/correct" in row and row.get("groups/dropped", 0) == 0
    if env_id == "hr-vf-calc":
        samples = (run_dir / "rollouts" / "step_000000.jsonl").read_text()
        assert "calcadd(a,b)" in samples  # its tool server's tool, offered to the model
    else:
        assert all(row["eval/verifiers/problems"] == 2 for row in rows if "eval/verifiers/problems" in row)
        assert sum("eval/verifiers/problems" in row for row in rows) >= 1


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_verifiers_environment_trains_under_ray(tmp_path, ray_instance):
    """Under ``--cluster ray`` each episode runs on a rollout worker, which serves the environment
    (its interception server) for it; its calls are sampled from the driver."""
    from headrace.app.cli import main

    run_dir = tmp_path / "run"
    settings = {"env_options.id": "hr-vf-sum", "env_options.harness": "null", "advantages.filter_constant": "false",
                "cluster.kind": "ray", "cluster.rollout_workers": 2, "cluster.sampler_replicas": 1}  # fmt: skip
    argv = run_argv(env="verifiers", backend="sim", steps=2, batch_size=1, group_size=2, run_dir=run_dir, set=settings)
    assert main(argv) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["env/hr-vf-sum/verifiers/turns"] >= 1 and row["env/hr-vf-sum/agent/calls_per_episode"] >= 1
        assert row["groups/trained"] == 1 and row.get("rollout_errors/total", 0.0) == 0.0, row
