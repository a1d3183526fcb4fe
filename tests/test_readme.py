"""The README's env example works as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import run_sim

from headrace.plugins import registry

pytestmark = pytest.mark.timeout(30)


async def test_readme_env_example_registers_and_runs(tmp_path):
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "register_env" in block)
    with registry.envs.scoped("reverse"):  # registered for this test only
        exec(compile(code, "README.md", "exec"), {})
        # the sim never reverses a word: without the filter its constant groups still train
        summary = await run_sim(tmp_path, env="reverse", steps=2, set={"advantages.filter_constant": "false"})
    assert len(summary.metrics) == 2


async def test_readme_env_example_is_written_in_messages_for_any_model():
    """No token ids in it: the same env asks a chat model in the model's own template."""
    from headrace.envs.context import EnvContext
    from tests.env_helpers import action
    from tests.test_renderers import chatml_tokenizer

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "register_env" in block)
    assert "encode(" not in code and "tokenizer" not in code
    with registry.envs.scoped("reverse"):
        exec(compile(code, "README.md", "exec"), {})
        ctx = EnvContext(chatml_tokenizer(), 2, 1, 1, 0, max_tokens=8, renderer_name="chat_template")
        env = (await registry.envs.get("reverse")(ctx).get_batch(0)[0].make_envs())[0]
    prompt, _ = await env.initial_observation()
    assert prompt == ctx.renderer.build_generation_prompt(
        [
            {
                "role": "user",
                "content": f"write the letters of {env.word} in reverse order. answer with the letters only.",
            }
        ]
    )
    result = await env.step(action(ctx.renderer, env.word[::-1]))
    assert result.reward == 1.0 and result.metrics["exact"] == 1.0


def test_readme_from_python_example_runs_with_the_cli_display(tmp_path, monkeypatch, capsys):
    """The "From Python" block, after the env block, as a script would run them: only the config is
    made quick (the sim backend, 2 small steps) and the run directory defaulted inside tmp_path."""
    import headrace

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    env_code = next(block for block in blocks if "register_env" in block)
    script = next(block for block in blocks if "run_with_progress" in block)
    real = headrace.build_config
    quick = {"backend": "sim", "steps": 2, "batch_size": 2, "group_size": 2, "progress": True}
    filter_off = ["advantages.filter_constant=false"]  # the sim's constant groups still train
    monkeypatch.setattr(headrace, "build_config", lambda flags: real(flags={**flags, **quick}, overrides=filter_off))
    monkeypatch.chdir(tmp_path)
    with registry.envs.scoped("reverse"):
        namespace: dict = {}
        exec(compile(env_code, "README.md", "exec"), namespace)
        exec(compile(script, "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    run_dir = namespace["summary"].run_dir
    assert run_dir.startswith("runs/reverse-sync-sim-") and (tmp_path / run_dir / "metrics.jsonl").is_file()
    # what `headrace run` shows: the run dir first, then the summary table and the totals line
    assert out.index(f"headrace: run dir {run_dir}") < out.index("run finished") < out.index("2 steps in")
    assert re.search(rf"{re.escape(run_dir)} -?\d+\.\d+$", out.rstrip())  # the block's own print


@pytest.mark.slow
@pytest.mark.timeout(900)  # 5.7 min measured on a CPU shared with three other jobs
async def test_readme_env_example_learns_on_the_default_model(tmp_path):
    """What the README says of its example: on the embedded model, 40 steps raise the reward."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "register_env" in block)
    with registry.envs.scoped("reverse"):
        exec(compile(code, "README.md", "exec"), {})
        summary = await run_sim(tmp_path, env="reverse", backend="torch", steps=40, batch_size=32, group_size=16)
    rewards = [row["reward/mean"] for row in summary.metrics]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.25, rewards  # measured: 0.02 -> 0.37


async def test_readme_agent_example_runs_its_loop_and_its_tools():
    """The "Bring your agent" block, its episode driven by a scripted sampler: a call, its result, the answer."""
    pytest.importorskip("openai")
    from headrace.agents.env import AgentEnv
    from headrace.core.episode import run_episode
    from tests.test_agents import SPEC, Script, endpoint

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "agent_env" in block)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    script = Script("<call>add(a=2,b=3)</call>", "5")
    trajectory = await run_episode(AgentEnv(scope["solve"], (2, 3), endpoint()), script, SPEC, seed=0)
    assert trajectory.total_reward == 1.0 and len(trajectory.transitions) == 2
    assert trajectory.transitions[-1].metrics["agent/tool_calls"] == 1.0
