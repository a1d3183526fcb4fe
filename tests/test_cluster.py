"""`--cluster ray` on a local Ray instance (loopback, one for every test): the same schedulers and
metrics as one process, and no step lost when a rollout worker and a sampler replica die."""

from __future__ import annotations

import asyncio
import builtins
import json
import math
import os

import pytest

from headrace.core.errors import ConfigError
from headrace.run.backends import make_backend
from headrace.run.config import build_config
from tests.helpers import Traced, traced_train

ONE_LEARNER: dict[str, list[dict]] = {}  # backend -> the metrics of its one-learner cluster run

# timing and queue figures differ between any two runs; everything else must not
VARIES = ("time/", "throughput/", "queue/", "optim/forward_backward_calls")


def config(tmp_path, name: str, cluster: bool, **flags):
    overrides = [f"{k}={v}" for k, v in flags.pop("set", {}).items()]
    if cluster:
        overrides += ["cluster.kind=ray", "cluster.rollout_workers=2", "cluster.sampler_replicas=1"]
    # the untrained tiny model is rarely right (the whole answer is graded): constant groups still train
    overrides.append("advantages.filter_constant=false")
    base = dict(steps=3, batch_size=4, group_size=4, seed=3, run_dir=str(tmp_path / name), progress=False)
    return build_config(flags=base | flags, overrides=overrides)


def compared(row: dict) -> dict:
    """What must match exactly: rewards, group counts, staleness, versions (the learner's own
    figures, computed from logprobs of another process's sampler, within 1e-5: ``close``)."""
    return {k: v for k, v in row.items() if not k.startswith((*VARIES, "optim/", "loss/"))}


def close(a: dict, b: dict) -> None:
    learner = [k for k in a if k.startswith(("optim/", "loss/")) and k != "optim/forward_backward_calls"]
    assert learner == [k for k in b if k.startswith(("optim/", "loss/")) and k != "optim/forward_backward_calls"]
    for k in learner:
        assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-5), (k, a[k], b[k])


def test_without_ray_the_error_names_the_extra(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ConfigError, match=r"headrace\[ray\]"):
        make_backend(config(tmp_path, "a", True, backend="sim"))


def test_a_remote_service_backend_is_refused_on_the_cluster(tmp_path):
    with pytest.raises(ConfigError, match="tinker"):
        make_backend(config(tmp_path, "a", True, backend="tinker", set={"tinker.base_url": "http://127.0.0.1:1"}))


def test_inflight_is_refused_on_the_cluster_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="--scheduler async"):
        make_backend(config(tmp_path, "a", True, backend="sim", scheduler="inflight"))


@pytest.mark.parametrize("backend", ["sim", "torch"])
@pytest.mark.slow
@pytest.mark.ray
async def test_one_learner_process_matches_the_single_process_run(tmp_path, ray_instance, backend):
    flags = {"backend": backend, "scheduler": "sync"}
    if backend == "torch":
        flags["set"] = {"sampling.max_tokens": 4}
    alone = await traced_train(config(tmp_path, "alone", False, **dict(flags)))
    spread = await traced_train(config(tmp_path, "ray", True, **dict(flags)))
    ONE_LEARNER[backend] = spread.metrics  # the two-learner test compares with it
    assert [compared(r) for r in spread.metrics] == [compared(r) for r in alone.metrics]
    for a, b in zip(alone.metrics, spread.metrics, strict=True):
        close(a, b)
    if backend == "torch":
        trained = [r for r in spread.metrics if "optim/loss" in r]
        assert trained and all(r["time/publish"] > 0 for r in trained)  # each update: the last publish's time


@pytest.mark.slow
@pytest.mark.ray
async def test_two_learner_processes_stay_within_tolerance(tmp_path, ray_instance):
    flags = {"backend": "torch", "scheduler": "sync", "set": {"sampling.max_tokens": 4}}
    if "torch" not in ONE_LEARNER:  # run alone (the test above leaves its run here)
        ONE_LEARNER["torch"] = (await traced_train(config(tmp_path, "one", True, **dict(flags)))).metrics
    one_metrics = ONE_LEARNER["torch"]
    flags["set"] = {**flags["set"], "cluster.learner_processes": 2}
    two = await traced_train(config(tmp_path, "two", True, **dict(flags)))
    # until the first update, both sample the same weights: the same data, and that update's loss
    # differs only by the order of float sums (measured 3.2e-7: tests/test_cluster_learner.py)
    first = next(i for i, r in enumerate(one_metrics) if "optim/loss" in r)
    for a, b in zip(one_metrics[: first + 1], two.metrics[: first + 1], strict=True):
        assert compared(a) == compared(b)
    a, b = one_metrics[first], two.metrics[first]
    assert math.isclose(a["optim/loss"], b["optim/loss"], rel_tol=1e-5, abs_tol=1e-5), (
        a["optim/loss"],
        b["optim/loss"],
    )


@pytest.mark.slow
@pytest.mark.ray
async def test_a_dead_rollout_worker_and_sampler_replica_lose_no_step(tmp_path, ray_instance):
    killed: list[str] = []
    trace = Traced()

    def kill_at_step_1(row: dict) -> None:
        if row["step"] != 1:
            return
        ray_instance.kill(trace.backend.pool.actors[0], no_restart=False)
        ray_instance.kill(trace.backend.sampling._slots[0].actor, no_restart=False)
        killed.append("both")

    flags = {"backend": "sim", "scheduler": "async", "steps": 6, "set": {"retry.budget": 32}}
    from headrace.run.train import train

    summary = await train(config(tmp_path, "faults", True, **flags), tracer=trace, on_step=kill_at_step_1)
    assert killed and [r["step"] for r in summary.metrics] == list(range(6))
    assert all(r["groups/trained"] + r["groups/filtered"] == 4 for r in summary.metrics)
    assert sum(r["groups/dropped"] for r in summary.metrics) == 0
    assert trace.backend.sampling.restarts == 1
    # the dead worker's envs failed under their members, which were re-run with fresh envs; the
    # replica's death is retried below the rollout (a transient error), even when Ray restarted it
    # before any request saw it die (it then says so on the next one)
    errors = {k: v for k, v in summary.metrics[-1].items() if k.startswith("rollout_errors/") and v}
    assert set(errors) == {"rollout_errors/total", "rollout_errors/WorkerDied"}, errors


async def _restarted(ray, actor) -> None:
    """Kill ``actor`` and wait until Ray has it running again in a new process: nothing of the run
    saw it die."""
    old = await actor.__ray_call__.remote(lambda _: os.getpid())
    ray.kill(actor, no_restart=False)
    for _ in range(600):
        try:
            if await actor.__ray_call__.remote(lambda _: os.getpid()) != old:
                return
        except ray.exceptions.ActorUnavailableError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("Ray did not restart the actor within 60 s")


@pytest.mark.slow
@pytest.mark.ray
async def test_a_worker_and_a_replica_restarted_between_two_calls_say_so(tmp_path, ray_instance):
    from headrace.backends.ray.workers import WorkerDied
    from headrace.core.protocols import TransientBackendError
    from headrace.core.types import SamplingParams
    from headrace.run.train import make_dataset

    cfg = config(tmp_path, "between", True, backend="sim", set={"cluster.rollout_workers": 1})
    async with make_backend(cfg) as backend:
        builder = backend.distribute(make_dataset(cfg, backend)).get_batch(0)[0]
        envs = await builder.make_envs()
        prompt, _ = await envs[0].initial_observation()
        handle, params = backend.initial_handle(), SamplingParams(max_tokens=4)
        assert await backend.sampling.sample(handle, prompt, 2, params)

        await _restarted(ray_instance, backend.pool.actors[0])
        with pytest.raises(WorkerDied, match="restarted"):  # its group's envs died with the old process
            await envs[1].initial_observation()
        assert backend.pool.restarts == 0  # the worker itself is up: a fresh group opens there
        assert await (await builder.make_envs())[0].initial_observation() == (prompt, _)

        await _restarted(ray_instance, backend.sampling._slots[0].actor)
        with pytest.raises(TransientBackendError):  # not the "holds versions []" of an unstarted replica
            await backend.sampling.sample(handle, prompt, 2, params)
        assert backend.sampling.restarts == 1
        assert len(await backend.sampling.sample(handle, prompt, 2, params)) == 2  # (waits for it to be back)
        await builder.cleanup()


@pytest.mark.slow
@pytest.mark.ray
async def test_a_dead_learner_process_fails_the_run_clearly_and_resume_continues_exactly(tmp_path, ray_instance):
    from headrace.backends.ray.learner import LearnerRankLost
    from headrace.run.train import train

    flags = {
        "backend": "sim",
        "scheduler": "sync",
        "steps": 6,
        "set": {"checkpoint.every": 2, "advantages.filter_constant": "false"},
    }
    whole = await traced_train(config(tmp_path, "whole", True, **dict(flags)))
    trace = Traced()

    def kill_at_step_3(row: dict) -> None:
        if row["step"] == 3:
            ray_instance.kill(trace.backend.training.learner.ranks[0], no_restart=True)

    cut = config(tmp_path, "cut", True, **dict(flags))
    with pytest.raises(BaseException) as caught:
        await train(cut, tracer=trace, on_step=kill_at_step_3)
    error = caught.value
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, LearnerRankLost) and "--resume" in str(error)
    resumed = await traced_train(cut.model_copy(update={"resume": True}))
    rows = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    assert [compared(r) for r in rows] == [compared(r) for r in whole.metrics]
    assert resumed.metrics[0]["step"] == 4  # from the checkpoint after step 4
