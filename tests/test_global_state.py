"""What a run changes in the process is scoped to the run: two runs in one event loop each keep
their own log and their own backoff, structlog's configuration is the application's, torch's thread
count is what it was once a backend is done, and a name registered for a block leaves with it."""

from __future__ import annotations

import json
import sys

import anyio
import pytest
import structlog
from helpers import run_sim

from headrace.core.retry import TransientBackendError
from headrace.core.trace import CallCompleted
from headrace.plugins import registry
from headrace.plugins.registry import UnknownNameError

pytestmark = pytest.mark.timeout(60)

SLOW_SAMPLING = {"sim.sample_token_s": 0.001, "advantages.filter_constant": "false"}


def log_lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


async def run_both(tmp_path, a: dict, b: dict) -> dict:
    summaries = {}

    async def one(name, flags):
        summaries[name] = await run_sim(tmp_path / name, **flags)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "a", a)
        tg.start_soon(one, "b", b)
    return summaries


async def test_two_concurrent_runs_write_their_own_logs_and_leave_structlog_alone(tmp_path):
    before = structlog.get_config()
    # a logs rollout errors (20% of its env steps fail), b has none to log
    await run_both(
        tmp_path,
        dict(env="flaky_arithmetic", steps=4, set=SLOW_SAMPLING | {"retry.budget": 50}),
        dict(env="arithmetic", steps=4, set=SLOW_SAMPLING),
    )
    logs = {name: log_lines(tmp_path / name / "run") for name in "ab"}
    for name, lines in logs.items():
        events = [line["event"] for line in lines]
        assert events[0] == "run_start" and events[-1] == "run_end", f"run {name} logged {events}"
        assert lines[0]["run_dir"] == str(tmp_path / name / "run")
        assert events.count("run_start") == 1, f"run {name}'s log holds the other run's lines"
    assert any(line["event"] == "rollout_error" for line in logs["a"])
    assert not any(line["event"] == "rollout_error" for line in logs["b"]), "a's errors went to b's log"
    # they did run at the same time
    start, end = (
        {n: next(x["timestamp"] for x in logs[n] if x["event"] == e) for n in "ab"} for e in ("run_start", "run_end")
    )
    assert start["a"] < end["b"] and start["b"] < end["a"], "the runs did not overlap"
    assert structlog.get_config() == before, "a run reconfigured structlog for the whole process"


async def test_each_run_retries_with_its_own_backoff(tmp_path):
    """The same transient faults, both runs at once: retried by the run that allows it; the run that
    allows a single try stops at its first (a backend failing after its retries ends the run)."""
    faults = SLOW_SAMPLING | {"sim.sample_fail_rate": 0.2, "retry.budget": 50, "retry.backoff_initial_s": 0.001}
    summaries: dict = {}
    stopped: list[BaseException] = []

    async def one(name, flags):
        try:
            summaries[name] = await run_sim(tmp_path / name, **flags)
        except TransientBackendError as e:
            stopped.append(e)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "a", dict(steps=3, set=faults | {"retry.backoff_attempts": 1}))
        tg.start_soon(one, "b", dict(steps=3, set=faults | {"retry.backoff_attempts": 6}))
    assert len(stopped) == 1 and "injected transient fault" in str(stopped[0]) and set(summaries) == {"b"}
    retried = summaries["b"]
    assert sum(isinstance(e, CallCompleted) and not e.ok for e in retried.trace.events) > 0, "b met no fault"
    assert sum(r.get("rollout_errors/TransientBackendError", 0) for r in retried.metrics) == 0


async def test_torch_backends_give_back_the_callers_threads_and_switch_interval(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from torch_helpers import config

    from headrace.run.backends import make_backend

    callers, interval = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(2)
    try:
        first = make_backend(config(tmp_path / "a"))  # the tiny model on CPU: 1 thread for the device
        second = make_backend(config(tmp_path / "b"))
        assert first.describe()["torch_threads"] == 1
        assert torch.get_num_threads() == 2, "building the backend changed the process's thread count"
        # two at once, the first to start stops first (as the Tinker emulator's models do)
        await first.__aenter__()
        await second.__aenter__()
        assert (await first.training.publish(1)).version == 1
        assert sys.getswitchinterval() < interval
        await first.__aexit__(None, None, None)
        assert sys.getswitchinterval() < interval, "the second backend lost its fast switching"
        await second.__aexit__(None, None, None)
        assert torch.get_num_threads() == 2
        assert sys.getswitchinterval() == interval
    finally:
        torch.set_num_threads(callers)
        sys.setswitchinterval(interval)


def test_a_name_registered_for_a_block_leaves_with_it():
    def mine(ctx):
        raise AssertionError("never built")

    with registry.envs.temporarily("test_scoped_env", mine):
        assert registry.envs.get("test_scoped_env") is mine
        assert "test_scoped_env" in registry.envs.names()
    with pytest.raises(UnknownNameError):
        registry.envs.get("test_scoped_env")
    arithmetic = registry.envs.get("arithmetic")
    with registry.envs.temporarily("arithmetic", mine):  # shadowing a built-in, then giving it back
        assert registry.envs.get("arithmetic") is mine
    assert registry.envs.get("arithmetic") is arithmetic
    with registry.envs.scoped("test_decorated_env"):
        registry.register_env("test_decorated_env")(mine)
        assert registry.envs.get("test_decorated_env") is mine
    assert "test_decorated_env" not in registry.envs.names()
