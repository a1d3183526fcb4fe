"""The learner as K data-parallel Ray processes (headrace/backends/ray/learner.py): one rank trains
exactly as the in-process backend, two within float-summation tolerance, and a dead rank stops
the run with an error that says how to go on."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio

from tests.torch_helpers import datum

torch = pytest.importorskip("torch")

from headrace.backends.ray.config import RayConfig  # noqa: E402
from headrace.backends.ray.data_parallel import loss_divisor, merge_metrics, shard_bounds  # noqa: E402
from headrace.backends.ray.learner import LearnerRankLost, start_learner  # noqa: E402
from headrace.backends.ray.runtime import import_ray  # noqa: E402
from headrace.core.errors import ConfigError  # noqa: E402
from headrace.core.protocols import InnerBackend  # noqa: E402
from headrace.core.types import AdamParams, Datum, LossSpec, SamplingParams  # noqa: E402
from headrace.run.backends import context, make_backend  # noqa: E402
from headrace.run.config import RunConfig  # noqa: E402

PROMPTS = ["3+4=", "1+2=", "12+30=", "0+0="]
ADAM = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
LOSS = LossSpec("ppo")  # has :max/:min metrics to merge as well
# K=2 sums the same float32 gradients in another order (rounding-level, ~2e-7 relative); Adam's
# first steps (g / (|g| + eps)) amplify that where |g| is tiny. Measured on CPU, two steps at lr
# 1e-2: optim/loss 3e-7, weights 1.4e-4 -- the same order as one process merely regrouping its
# forward_backward calls (9e-5).
K2_LOSS_TOL = 1e-5
K2_WEIGHT_TOL = 1e-3


def run_config(backend: str = "torch") -> RunConfig:
    return RunConfig(seed=0, backend=backend, torch={"device": "cpu"})


def learner(processes: int, backend: str = "torch"):
    """``processes`` ranks of the run's training backend, as ``--cluster ray`` starts them."""
    config = run_config(backend)
    inner = InnerBackend(config.backend, config.section(config.backend).model_dump())
    return start_learner(RayConfig(learner_processes=processes), context(config), inner)


async def sample_datums() -> list[Datum]:
    async with make_backend(run_config()) as backend:
        tok, handle = backend.tokenizer, backend.initial_handle()
        prompts = [tok.encode(p) for p in PROMPTS]
        params = SamplingParams(max_tokens=6, seed=7)
        groups = await asyncio.gather(*[backend.sampling.sample(handle, p, 2, params) for p in prompts])
    pairs = [(p, s) for p, g in zip(prompts, groups, strict=True) for s in g]
    return [datum(p, s, 1.0 if i % 2 else -1.0) for i, (p, s) in enumerate(pairs)]


async def train(training, weights_of, datums: list[Datum]) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Two steps of two forward_backward calls each; the second holds one datum, so with two
    ranks one of them gets an empty shard. Every call is queued before the first is awaited."""
    pending, handles = [], []
    for step in range(2):
        pending.append(training.forward_backward(datums[:-1], LOSS))
        pending.append(training.forward_backward(datums[-1:], LOSS))
        pending.append(training.optim_step(ADAM))
        handles.append(training.publish(step + 1))
    results = [await p for p in pending]
    last = [await h for h in handles][-1]
    return [r.metrics for r in results], weights_of(last)


def worst(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    # weights_of gives (array, "") per tensor ("bfloat16" when the array holds bf16 bits)
    return max(float(np.abs(a[k][0] - b[k][0]).max()) for k in a)


def _untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("perf/")}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def two_ranks(ray_instance):
    """One two-rank learner (two torch processes, 10-20 s to start on a loaded machine) for the
    two tests below: the tolerance test trains it from its initial weights (so it is the first to
    use it: file order), then the dead-rank test kills one of its ranks (so it is the last)."""
    training = await learner(2)
    try:
        yield training
    finally:
        if ray_instance.is_initialized():  # shut down (conftest: after the last Ray test), its actors went with it
            await training.stop()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.usefixtures("ray_instance")
async def test_one_rank_matches_in_process_and_two_ranks_stay_within_tolerance(two_ranks):
    datums = await sample_datums()
    async with make_backend(run_config()) as backend:
        local_metrics, local_weights = await train(backend.training, backend.weights_of, datums)

    for k in (1, 2):
        training = await learner(1) if k == 1 else two_ranks
        try:
            training.check_loss(LOSS)
            metrics, weights = await train(training, lambda h: import_ray().get(h.ref), datums)
        finally:
            if k == 1:
                await training.stop()
        assert len(metrics) == len(local_metrics)
        if k == 1:  # the same process-local computation: bit for bit (its perf/ rates and MFU aside: timing)
            assert [_untimed(m) for m in metrics] == [_untimed(m) for m in local_metrics]
            assert worst(weights, local_weights) == 0.0
            continue
        loss_gap = max(
            abs(m["optim/loss"] - r["optim/loss"])
            for m, r in zip(metrics, local_metrics, strict=True)
            if "optim/loss" in r
        )
        weight_gap = worst(weights, local_weights)
        print(f"K=2: optim/loss within {loss_gap:.2e}, weights within {weight_gap:.2e}")
        assert loss_gap < K2_LOSS_TOL and weight_gap < K2_WEIGHT_TOL
        for i, (m, r) in enumerate(zip(metrics, local_metrics, strict=True)):
            assert m.keys() == r.keys()
            # a rank's shard puts other datums beside each other in the shared-prefix rows, so
            # every logprob moves by float32 round-off (~1e-6), and the means taken of them with it.
            # After the first optim_step (the first three calls) the weights differ by the weight
            # gap as well (2.5-3.8e-4 measured), and the second step's logprobs with them: a
            # per-token extreme such as loss/ratio_min moved by 2.6e-5 on one set of samples. A
            # shard summed wrongly or a datum lost moves these by 1e-2 or more.
            tol = 2e-5 if i < 3 else 1e-4
            assert _untimed(m) == pytest.approx(_untimed(r), rel=1e-5, abs=tol), i


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.usefixtures("ray_instance")
async def test_a_dead_rank_stops_the_run_with_a_clear_error(two_ranks):
    datums = await sample_datums()
    training = two_ranks  # the tolerance test's learner, after its two steps (its ranks' state is no matter here)
    await training.forward_backward(datums, LOSS)
    import_ray().kill(training.ranks[1])
    # rank 0 is then alone in the all-reduce: its failure must not hide the death
    with pytest.raises(LearnerRankLost, match=r"learner process 1 of 2 died.*--resume"):
        await asyncio.wait_for(training.optim_step(ADAM), 60)


def test_shards_are_contiguous_and_balanced_by_loss_tokens():
    def d(loss_tokens: int) -> Datum:
        n = loss_tokens + 2
        return Datum(list(range(n)), list(range(n)), [0.0] * n, [0.0] * n, [0.0] * 2 + [1.0] * loss_tokens)

    assert shard_bounds([d(1), d(1), d(10), d(1), d(1)], 2) == [0, 3, 5]
    assert shard_bounds([d(4)] * 4, 2) == [0, 2, 4]
    assert shard_bounds([d(4)], 3) == [0, 0, 1, 1]
    assert shard_bounds([d(0)] * 4, 2) == [0, 2, 4]  # no loss tokens: by count
    assert shard_bounds([], 2) == [0, 0, 0]
    assert loss_divisor([d(3), d(0)], LossSpec(config={"aggregation": "sequence_mean"})) == 1.0
    merged = merge_metrics(
        [
            {"optim/loss": 1.0, "optim/loss_tokens:sum": 1.0, "x:max": 1.0},
            {"optim/loss": 3.0, "optim/loss_tokens:sum": 3.0},
        ],
        [1.0, 3.0],
    )
    assert merged == {"optim/loss": 2.5, "optim/loss_tokens:sum": 4.0, "x:max": 1.0}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("ray_instance")
async def test_a_backend_without_gradients_runs_one_rank_and_refuses_two():
    training = await learner(1, "sim")
    try:
        await training.forward_backward([Datum([1, 2], [2, 3], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0])], LossSpec())
        await training.optim_step(ADAM)
        handle = await training.publish(1)
        assert handle.version == 1 and import_ray().get(handle.ref) is None  # sim's weights are its version
    finally:
        await training.stop()
    with pytest.raises(ConfigError, match="learner_processes=2"):
        await learner(2, "sim")
