"""The ``tinker`` backend's primitives through the SDK against the emulator: pipelining in the
clock cycles, sampling n per call, exactly-once recovery, manifest resume, clear errors."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
from tinker_support import assert_no_double_apply, backend_config, emulator, ops, step_datums, tinker_env  # noqa: F401

from headrace.backends.tinker import FILENAME, TinkerRecoveryError
from headrace.backends.tinker.connect import TinkerConnectionError
from headrace.core.errors import ConfigError
from headrace.core.types import AdamParams, LossSpec, SamplingParams, StopReason
from headrace.run.backends import make_backend

pytestmark = [pytest.mark.tinker, pytest.mark.timeout(120)]
ADAM = AdamParams(learning_rate=0.05)
LOSS = LossSpec("importance_sampling")


async def _learner(backend, steps: range) -> list[list[list[float]]]:
    """The learner's pattern: submit step k, then await step k-1 (one step in flight)."""
    logprobs, pending = [], None
    for k in [*steps, None]:
        submitted = None
        if k is not None:
            fb = backend.training.forward_backward(step_datums(k), LOSS)
            submitted = (fb, backend.training.optim_step(ADAM), backend.training.publish(k + 1))
        if pending is not None:
            fb, opt, pub = pending
            logprobs.append((await fb).logprobs_D)
            await opt
            assert (await pub).version == len(logprobs) + steps.start
        pending = submitted
    return logprobs


async def test_pipelined_calls_queue_ahead(tmp_path):
    """Step k+1's data is ready while step k trains (0.1 s of "rollouts"); its calls go out at
    once, behind step k's, without waiting for step k's results."""
    with emulator(clock_cycle_s=0.25, latency_s=0.1, follow_s=0) as emu:
        async with make_backend(backend_config(emu.url, tmp_path, commit_every=0)) as backend:
            training = backend.training

            def submit(k):
                return (
                    training.forward_backward(step_datums(k), LOSS),
                    training.optim_step(ADAM),
                    training.publish(k + 1),
                )

            pending = submit(0)
            for k in range(1, 6):
                await asyncio.sleep(0.1)  # the next batch's rollouts
                following = submit(k)
                for future in pending:
                    await future
                pending = following
            for future in pending:
                await future
            model = training.client.model_id
        log = emu.log()
    fbs, opts = ops(log, "forward_backward", model), ops(log, "optim_step", model)
    assert len(fbs) == len(opts) == 6
    assert all(fb["seq_id"] + 1 == opt["seq_id"] for fb, opt in zip(fbs, opts, strict=True))
    for prev_opt, next_fb in zip(opts, fbs[1:], strict=False):
        assert next_fb["submit_t"] < prev_opt["fetch_t"], "the next step was not queued before the last result was read"


async def test_a_step_is_one_request_in_one_cycle_with_hard_boundaries(tmp_path):
    """The SDK sends one training client's requests one at a time, so a step sent as four
    forward_backwards and an optim_step was a chain that a boundary could cut (measured: 7 of 20
    stream steps in two cycles). The step's minibatches now go out as one request with its
    optim_step. Step 0's four minibatches come in well inside a cycle; step 1's straddle a
    boundary, two before and two after: each step lands whole in one cycle, publish included."""
    cycle = 1.0  # room for a loaded machine (at 0.5 s, one run on a shared 2-core machine failed)
    with emulator(clock_cycle_s=cycle, follow_s=0) as emu:
        async with make_backend(backend_config(emu.url, tmp_path, commit_every=0)) as backend:
            training = backend.training
            origin = ops(emu.log(), "save_weights_for_sampler")[0]["start_t"]  # the first publish ran at a boundary

            async def until(offset: float) -> None:
                """Sleep until ``offset`` seconds after (or, negative, before) a coming boundary."""
                now = time.time()
                target = origin + (math.floor((now - origin) / cycle) + 1) * cycle + offset
                while target < now + 0.01:
                    target += cycle
                await asyncio.sleep(target - now)

            async def step(k: int, before: int) -> None:
                """Four minibatches, ``before`` of them in the cycle before the boundary, the rest after."""
                for j in range(4):
                    if j == 0:
                        await until(-0.3 if before else 0.2)
                    if j == before and before:
                        await until(0.2)
                    datums = step_datums(4 * k + j)
                    calls.append((datums, training.forward_backward(datums, LOSS)))
                    await asyncio.sleep(0.02)  # the next group's rollouts
                optim, publish = training.optim_step(ADAM), training.publish(k + 1)
                await optim
                await publish

            calls: list = []
            await step(0, before=0)
            await step(1, before=2)
            for datums, submitted in calls:
                result = await submitted
                assert [len(row) for row in result.logprobs_D] == [len(d.target_tokens) for d in datums]
            model = training.client.model_id
        log = emu.log()
    fbs, opts = ops(log, "forward_backward", model), ops(log, "optim_step", model)
    publishes = ops(log, "save_weights_for_sampler", model)[1:]
    assert len(fbs) == len(opts) == len(publishes) == 2, "a step's minibatches go out as one request"
    for fb, opt, pub in zip(fbs, opts, publishes, strict=True):
        assert fb["cycle"] == opt["cycle"] == pub["cycle"], (fb, opt, pub)


async def test_a_forward_backward_awaited_alone_is_sent(tmp_path):
    """A held forward_backward goes out when it is awaited: no optim_step need follow it."""
    with emulator() as emu:
        async with make_backend(backend_config(emu.url, tmp_path, commit_every=0)) as backend:
            datums = step_datums(0)
            result = await asyncio.wait_for(backend.training.forward_backward(datums, LOSS), 20)
            assert len(result.logprobs_D) == 2
            assert result.metrics["loss_tokens"] == sum(d.num_loss_tokens for d in datums)
            model = backend.training.client.model_id
        assert len(ops(emu.log(), "forward_backward", model)) == 1


@pytest.mark.parametrize("merge", [True, False])
async def test_merge_forward_backward_decides_the_requests_per_step(tmp_path, merge):
    with emulator() as emu:
        async with make_backend(backend_config(emu.url, tmp_path, merge_forward_backward=merge)) as backend:
            training = backend.training
            submitted = [training.forward_backward(step_datums(j), LOSS) for j in range(3)]
            await training.optim_step(ADAM)
            assert [len((await s).logprobs_D) for s in submitted] == [2, 2, 2]
            model = training.client.model_id
        assert len(ops(emu.log(), "forward_backward", model)) == (1 if merge else 3)


async def test_a_step_that_applied_no_update_keeps_the_samplers_weights(tmp_path):
    """Every group filtered: the learner publishes without an optim_step. The sampler keeps the
    weights it has: no save_weights_for_sampler round trip (a clock cycle on the service)."""
    with emulator() as emu:
        async with make_backend(backend_config(emu.url, tmp_path, commit_every=0)) as backend:
            training, first = backend.training, backend.initial_handle()
            same = await training.publish(1)
            assert (same.version, same.ref) == (1, first.ref)
            training.forward_backward(step_datums(0), LOSS)
            training.optim_step(ADAM)
            trained = await training.publish(2)
            again = await training.publish(3)
            assert trained.ref is not first.ref and (again.version, again.ref) == (3, trained.ref)
            samples = await backend.sampling.sample(again, [5, 6], 2, SamplingParams(max_tokens=3, seed=1))
            assert len(samples) == 2
            model = training.client.model_id
        saves = ops(emu.log(), "save_weights_for_sampler", model)
    assert len(saves) == 2, "only the first publish and the one after an optim_step save weights"


async def test_sample_asks_for_the_whole_group_in_one_call(tmp_path):
    with emulator() as emu:
        async with make_backend(backend_config(emu.url, tmp_path)) as backend:
            assert type(backend.tokenizer).__name__ == "CharTokenizer"
            handle = backend.initial_handle()
            prompt = backend.tokenizer.encode("1+2=")
            samples = await backend.sampling.sample(handle, prompt, 8, SamplingParams(max_tokens=6, seed=3))
            assert len(samples) == 8
            for s in samples:
                assert len(s.tokens) == len(s.logprobs) <= 6 and all(lp <= 0 for lp in s.logprobs)
                assert s.stop_reason in (StopReason.STOP, StopReason.LENGTH)
                if s.stop_reason == StopReason.STOP:
                    assert s.tokens[-1] == backend.tokenizer.eos_token_id
            again = await backend.sampling.sample(handle, prompt, 8, SamplingParams(max_tokens=6, seed=3))
            assert [s.tokens for s in again] == [s.tokens for s in samples]  # the sampler's ids, untouched
        sample_ops = ops(emu.log(), "sample")
    assert len(sample_ops) == 2


async def _run_steps(url, run_dir, steps: int, **tinker):
    async with make_backend(backend_config(url, run_dir, **tinker)) as backend:
        logprobs = await _learner(backend, range(steps))
        final = await backend.training.publish(steps + 1)
        sample = await backend.sampling.sample(final, [5, 6], 4, SamplingParams(max_tokens=5, seed=7))
        return logprobs, [s.logprobs for s in sample], backend.training.recoveries, backend.training.client.model_id


@pytest.mark.slow
async def test_exactly_once_recovery_matches_a_clean_run(tmp_path):
    steps = 8
    with emulator() as clean:
        want_lp, want_sample, recoveries, _ = await _run_steps(clean.url, tmp_path / "clean", steps, commit_every=3)
        assert recoveries == []
    faults = dict(fail_after_apply_every=5, drop_every=4, http_5xx_every=5, try_again_polls=1)
    with emulator(**faults) as emu:
        got_lp, got_sample, recoveries, model = await _run_steps(emu.url, tmp_path / "faulty", steps, commit_every=3)
        assert_no_double_apply(emu)
        lineage = emu.models()[model]["lineage"]
    assert len(recoveries) >= 2
    assert len(lineage) == steps and len(set(lineage)) == steps
    assert got_lp == want_lp  # every step's learner logprobs: the same weights at every step
    assert got_sample == want_sample
    manifest = json.loads((tmp_path / "faulty" / FILENAME).read_text())
    assert len(manifest["recoveries"]) == len(recoveries)
    assert all(
        r["from_state"].startswith("tinker://") and "RequestFailedError" in r["error"] for r in manifest["recoveries"]
    )


async def test_a_timed_out_step_is_recovered(tmp_path):
    with emulator(stall_every=3, stall_s=60) as emu:
        _, _, recoveries, model = await _run_steps(emu.url, tmp_path, 4, commit_every=1, request_timeout_s=1.5)
        assert_no_double_apply(emu)
        assert emu.models()[model]["steps"] == 4
    assert recoveries and "Timeout" in recoveries[0]["error"]


async def test_without_a_committed_state_an_uncertain_step_fails_loudly(tmp_path):
    with emulator(fail_after_apply_every=1) as emu:
        async with make_backend(backend_config(emu.url, tmp_path, commit_every=0)) as backend:
            backend.training.forward_backward(step_datums(0), LOSS)
            with pytest.raises(TinkerRecoveryError, match="commit_every"):
                await backend.training.optim_step(ADAM)


async def test_resume_from_the_manifest_restores_weights_and_optimizer(tmp_path):
    with emulator() as emu:
        async with make_backend(backend_config(emu.url, tmp_path, commit_every=0)) as first:
            await _learner(first, range(3))
            path = await first.training.save_state("step_000003")
            want = await _learner(first, range(3, 6))  # continued without a break
        manifest = json.loads((tmp_path / FILENAME).read_text())
        assert [s["path"] for s in manifest["states"]] == [path] and manifest["states"][0]["step"] == 3
        assert manifest["samplers"] and manifest["samplers"][0]["path"].startswith("tinker://")

        config = backend_config(emu.url, tmp_path, commit_every=0).model_copy(update={"resume": True})
        async with make_backend(config) as resumed:
            assert resumed.training.loaded_path == path
            await resumed.training.load_state(path)  # what the runner does next: a no-op here
            got = await _learner(resumed, range(3, 6))
        async with make_backend(backend_config(emu.url, tmp_path / "other", commit_every=0)) as fresh:
            await fresh.training.load_state(str(tmp_path))  # a run directory: its manifest's latest state
            assert fresh.training.loaded_path == path
        resumed_model = emu.models()[resumed.training.client.model_id]
        loads = [
            r
            for r in ops(emu.log(), "load_weights")
            if r["model_id"].startswith(resumed.training.client.model_id.split(":")[0])
        ]
        assert len(loads) == 1, "the runner's load_state of the state already loaded must not load it again"
    assert got == want  # same weights and same Adam moments: identical from the first step on
    assert resumed_model["parent"] == path and len(resumed_model["lineage"]) == 6


async def test_no_key_and_no_emulator_names_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.tinker credentials either
    with pytest.raises(ConfigError, match="TINKER_API_KEY") as info:
        make_backend(backend_config(None, tmp_path))
    assert "tinker-emulator" in str(info.value)


async def test_an_unreachable_emulator_fails_fast_with_a_hint(tmp_path):
    backend = make_backend(backend_config("http://127.0.0.1:9", tmp_path))
    with pytest.raises(TinkerConnectionError, match="tinker-emulator"):
        await backend.__aenter__()


async def test_tokenizer_from_a_local_path(tmp_path):
    from pathlib import Path

    import headrace

    path = Path(headrace.__file__).parent / "assets" / "tokenizer.json"
    with emulator() as emu:
        async with make_backend(backend_config(emu.url, tmp_path, tokenizer=str(path))) as backend:
            from headrace.tokenizers.char import CharTokenizer

            assert backend.tokenizer.encode("12+3=") == CharTokenizer().encode("12+3=")
            assert backend.tokenizer.eos_token_id == CharTokenizer.eos_token_id
