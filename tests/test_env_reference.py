"""`headrace run --env path/to/file.py:NAME` and `--env package.module:NAME`: an env from a plain
file or an importable module, without packaging or registering it, through the real CLI."""

from __future__ import annotations

import json
import pickle
import sys
import textwrap
from pathlib import Path

import pytest

from headrace.app.cli import main
from headrace.plugins import registry

pytestmark = pytest.mark.timeout(60)

ENV_SOURCE = textwrap.dedent(
    """
    import random
    from dataclasses import dataclass

    from headrace import Env, EnvContext, GroupOf, ProblemDataset, StepResult, StopCondition

    @dataclass
    class Echo(Env):
        digit: str
        tokenizer: object

        async def initial_observation(self):
            tok = self.tokenizer
            return tok.encode(f"say {self.digit}:"), StopCondition(2, (tok.eos_token_id,))

        async def step(self, action):
            return StepResult(reward=float(self.tokenizer.decode(action.tokens).strip() == self.digit), done=True)

    def make_dataset(ctx: EnvContext) -> ProblemDataset:
        def group(rng: random.Random) -> GroupOf:
            return GroupOf.of(Echo, ctx.group_size, digit=str(rng.randrange(10)), tokenizer=ctx.tokenizer)

        return ProblemDataset.from_context(ctx, group)
    """
)
# the sim never says the digit: without the filter its constant groups still train
QUICK = ["--backend", "sim", "--steps", "2", "--batch-size", "2", "--group-size", "2", "--no-progress"]
QUICK += ["--set", "advantages.filter_constant=false"]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_env_from_a_plain_file_runs_through_the_cli(tmp_path, monkeypatch, capsys):
    (tmp_path / "my envs").mkdir()
    (tmp_path / "my envs" / "echo_env.py").write_text(ENV_SOURCE)
    monkeypatch.chdir(tmp_path)
    reference = "my envs/echo_env.py:make_dataset"
    assert main(["run", "--env", reference, *QUICK]) == 0, capsys.readouterr().err
    # the default run directory: one sane name under runs/, no '/' or ':' from the reference
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("echo_env-make_dataset-sync-sim-")
    assert [r["step"] for r in _rows(run_dir)] == [0, 1]
    assert json.loads((run_dir / "config.json").read_text())["env"] == reference
    # the file became a module of its own: its dataclass envs and their builders pickle
    builder = registry.envs.get(reference)(_ctx()).get_batch(0)[0]
    clone = pickle.loads(pickle.dumps(builder))
    assert clone.env_cls is builder.env_cls and clone.kwargs["digit"] == builder.kwargs["digit"]


def test_env_from_a_module_on_the_python_path_runs_through_the_cli(tmp_path, monkeypatch, capsys):
    package = tmp_path / "headrace_test_user_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "envs.py").write_text(ENV_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        run_dir = tmp_path / "run"
        argv = ["run", "--env", "headrace_test_user_pkg.envs:make_dataset", "--run-dir", str(run_dir), *QUICK]
        assert main(argv) == 0, capsys.readouterr().err
        assert [r["step"] for r in _rows(run_dir)] == [0, 1]
        assert "headrace_test_user_pkg.envs:make_dataset" not in registry.envs.names()  # nothing registered
    finally:
        for name in ("headrace_test_user_pkg.envs", "headrace_test_user_pkg"):
            sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        (
            "nowhere/echo_env.py:make_dataset",
            ["the file nowhere/echo_env.py does not exist", "relative to the current"],
        ),
        ("no_such_pkg_xyz.envs:make_dataset", ["no module named 'no_such_pkg_xyz'", "sys.path"]),
        (
            "ENVFILE:make_datset",
            ["has no attribute 'make_datset'", "It defines: Echo, make_dataset", "'make_dataset'?"],
        ),
        (
            "arithmatic",
            ["Did you mean 'arithmetic'", "'path/to/file.py:NAME'", "'package.module:NAME'", "headrace.envs"],
        ),
    ],
)
def test_an_env_that_cannot_be_found_is_one_paragraph(tmp_path, monkeypatch, capsys, env, fragments):
    (tmp_path / "echo_env.py").write_text(ENV_SOURCE)
    monkeypatch.chdir(tmp_path)
    env = env.replace("ENVFILE", str(tmp_path / "echo_env.py"))
    assert main(["run", "--env", env, *QUICK]) == 2
    err = capsys.readouterr().err
    assert err.startswith("headrace: error: ") and err.count("\n") == 1 and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err
    assert not (tmp_path / "runs").exists()  # refused before anything was written


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("x = 1\nraise RuntimeError('boom')\n", "raised RuntimeError at {path}:2: boom"),
        ("def make_dataset(ctx:\n", "raised SyntaxError"),
        ("import headrace_no_such_dependency\n", "No module named 'headrace_no_such_dependency'"),
    ],
)
def test_an_env_file_that_fails_to_import_is_one_paragraph(tmp_path, capsys, source, fragment):
    path = tmp_path / "broken_env.py"
    path.write_text(source)
    assert main(["run", "--env", f"{path}:make_dataset", "--run-dir", str(tmp_path / "run"), *QUICK]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"headrace: error: cannot load env '{path}:make_dataset': importing {path}")
    assert fragment.format(path=path) in err and err.count("\n") == 1


def _ctx():
    from headrace.envs.context import EnvContext
    from headrace.tokenizers.char import CharTokenizer

    return EnvContext(tokenizer=CharTokenizer(), group_size=2, batch_size=2, steps=2, seed=0, max_tokens=4)
