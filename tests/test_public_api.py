"""What `import headrace` offers a user: a typed, keyword-only `train`, the errors a run raises on
purpose and the protocols a backend implements, and dataset helpers that take the run's shape
from the EnvContext."""

from __future__ import annotations

import inspect

import pytest
from helpers import sim_config

import headrace
from headrace.core import advantages, episode, protocols, retry, rollout
from headrace.envs.arithmetic import ArithmeticEnv
from headrace.run import metrics
from headrace.run import train as run
from headrace.tokenizers.char import CharTokenizer

pytestmark = pytest.mark.timeout(30)


def test_errors_and_protocols_are_exported_as_themselves():
    exported = {
        "EnvContractError": episode.EnvContractError,
        "TooManyDroppedGroups": rollout.TooManyDroppedGroups,
        "NoUpdateApplied": metrics.NoUpdateApplied,
        "NonFiniteError": advantages.NonFiniteError,
        "TransientBackendError": retry.TransientBackendError,
        "Backend": protocols.Backend,
        "TrainingBackend": protocols.TrainingBackend,
        "SamplingBackend": protocols.SamplingBackend,
        "RunSummary": run.RunSummary,
    }
    for name, value in exported.items():
        assert getattr(headrace, name) is value and name in headrace.__all__
    assert all(hasattr(headrace, name) for name in headrace.__all__)


def test_train_takes_its_options_by_keyword():
    params = inspect.signature(headrace.train).parameters
    assert list(params) == ["config", "dataset", "on_step", "tracer", "handle_signals"]
    assert all(p.kind is p.KEYWORD_ONLY for name, p in params.items() if name != "config")
    assert inspect.iscoroutinefunction(headrace.train)


async def test_train_with_a_dataset_built_from_the_context(tmp_path):
    ctx = headrace.EnvContext(tokenizer=CharTokenizer(), group_size=2, batch_size=3, steps=2, seed=7, max_tokens=4)

    def group(rng):
        a, b = rng.randrange(5), rng.randrange(5)
        kwargs = dict(question=f"{a}+{b}=", answer=str(a + b), renderer=ctx.renderer, max_tokens=4)
        return headrace.GroupOf.of(ArithmeticEnv, ctx.group_size, **kwargs)

    dataset = headrace.ProblemDataset.from_context(ctx, group)
    assert (dataset.batch_size, len(dataset), dataset.seed) == (3, 2, 7)
    assert len(dataset.get_batch(1)) == 3 and dataset.get_batch(1)[0] == dataset.get_batch(1)[0]  # rebuilt alike
    rows: list[dict] = []
    config = sim_config(tmp_path, steps=2, batch_size=3, group_size=2, set={"advantages.filter_constant": "false"})
    summary = await headrace.train(config, dataset=dataset, on_step=rows.append)
    assert isinstance(summary, headrace.RunSummary) and [r["step"] for r in rows] == [0, 1]


def test_group_of_takes_the_env_arguments_by_name_only():
    with pytest.raises(TypeError, match="by name"):
        headrace.GroupOf.of(ArithmeticEnv, 2, "1+1=", "2", CharTokenizer(), 4)
