"""Envs by name: the decorator, the entry-point group, and unknown names."""

from __future__ import annotations

import sys
import textwrap

import pytest
from helpers import run_sim

from headrace import EnvContext, GroupOf, ProblemDataset, register_env
from headrace.envs.arithmetic import ArithmeticEnv
from headrace.plugins import registry
from headrace.plugins.registry import UnknownNameError

pytestmark = pytest.mark.timeout(30)


def make_constant_dataset(ctx: EnvContext) -> ProblemDataset:
    kwargs = dict(question="1+1=", answer="2", renderer=ctx.renderer, max_tokens=ctx.max_tokens)
    return ProblemDataset(
        lambda rng: GroupOf(ArithmeticEnv, kwargs, ctx.group_size, ("custom",)), ctx.batch_size, 10, 0
    )


async def test_custom_env_registered_with_the_decorator_runs_by_name(tmp_path):
    with registry.envs.scoped("test_constant_question"):  # what the decorator registers is gone after the block
        assert register_env("test_constant_question")(make_constant_dataset) is make_constant_dataset
        summary = await run_sim(
            tmp_path, env="test_constant_question", steps=2, set={"advantages.filter_constant": "false"}
        )
        assert "test_constant_question" in registry.envs.names()
    assert "env/custom/reward/mean" in summary.metrics[0]
    assert "test_constant_question" not in registry.envs.names()


async def test_env_from_an_entry_point_of_another_package(tmp_path, monkeypatch):
    pkg = tmp_path / "site"
    (pkg / "third_party_envs").mkdir(parents=True)
    (pkg / "third_party_envs" / "__init__.py").write_text(
        textwrap.dedent(
            """
            from headrace.envs.arithmetic import make_dataset as _arith

            def make_dataset(ctx):
                return _arith(ctx)
            """
        )
    )
    dist = pkg / "third_party_envs-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: third-party-envs\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[headrace.envs]\nplugin_arith = third_party_envs:make_dataset\n")
    monkeypatch.syspath_prepend(str(pkg))
    with registry.envs.scoped("plugin_arith"):  # found by a new scan, forgotten after the block
        registry.envs.rescan()
        assert "plugin_arith" in registry.envs.names()
        summary = await run_sim(tmp_path, env="plugin_arith", steps=2)
    assert len(summary.metrics) == 2
    assert "plugin_arith" not in registry.envs.names()
    sys.modules.pop("third_party_envs", None)


@pytest.mark.parametrize(
    ("reg", "name", "closest"),
    [
        (registry.envs, "arithmetc", "arithmetic"),
        (registry.schedulers, "asynk", "async"),
        (registry.backends, "sm", "sim"),
    ],
)
def test_unknown_name_lists_valid_names_and_the_closest(reg, name, closest):
    with pytest.raises(UnknownNameError) as info:
        reg.get(name)
    message = str(info.value)
    assert f"Did you mean '{closest}'?" in message
    for valid in reg.names():
        assert valid in message
