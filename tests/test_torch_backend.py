"""The torch backend on the embedded tiny model: sampler/learner agreement, versions, batching,
sampling options, loss normalisation, checkpoints."""

from __future__ import annotations

import asyncio

import pytest

from tests.torch_helpers import DEVICE, action_logprobs, config, datum

torch = pytest.importorskip("torch")

from headrace.core.protocols import SamplingBackend, TrainingBackend  # noqa: E402
from headrace.core.types import AdamParams, LossSpec, SamplingParams, StopReason, Tokenizer  # noqa: E402
from headrace.run.backends import make_backend  # noqa: E402

PROMPTS = ["3+4=", "1+2=", "12+30=", "0+0="]
ADAM = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
TOL = 1e-4


async def sample_datums(backend, handle, n=4, max_tokens=6, seed=None):
    tok = backend.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, seed=seed)
    groups = await asyncio.gather(*[backend.sampling.sample(handle, p, n, params) for p in prompts])
    pairs = [(p, s) for p, g in zip(prompts, groups, strict=True) for s in g]
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(pairs))]
    return [datum(p, s, a) for (p, s), a in zip(pairs, advantages, strict=True)]


def assert_agree(datums, result):
    worst = max(
        abs(a - b)
        for d, lps in zip(datums, result.logprobs_D, strict=True)
        for a, b in zip(action_logprobs(lps, d), action_logprobs(d.logprobs, d), strict=True)
    )
    assert worst < TOL, f"sampler and learner logprobs differ by {worst}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lora_rank", [0, 4])
async def test_sampler_and_learner_agree_before_and_after_an_update(lora_rank):
    async with make_backend(config(lora_rank=lora_rank)) as backend:
        assert isinstance(backend.training, TrainingBackend) and isinstance(backend.sampling, SamplingBackend)
        assert isinstance(backend.tokenizer, Tokenizer)
        handle = backend.initial_handle()
        datums = await sample_datums(backend, handle)
        assert_agree(datums, await backend.training.forward_backward(datums, LossSpec("importance_sampling")))
        await backend.training.optim_step(ADAM)
        handle = await backend.training.publish(1)
        datums = await sample_datums(backend, handle)
        result = await backend.training.forward_backward(datums, LossSpec("ppo"))
        assert_agree(datums, result)
        assert abs(result.metrics["optim/kl_sampler_learner"]) < TOL


@pytest.mark.timeout(60)
async def test_publish_changes_the_samples_and_old_handles_keep_their_weights():
    async with make_backend(config()) as backend:
        h0 = backend.initial_handle()
        assert h0.version == 0
        before = await sample_datums(backend, h0, seed=7)
        await backend.training.forward_backward(before, LossSpec("importance_sampling"))
        await backend.training.optim_step(ADAM)
        h1 = await backend.training.publish(1)
        assert h1.version == 1 and h1.ref is not h0.ref
        after = await sample_datums(backend, h1, seed=7)
        changed = max(abs(a - b) for x, y in zip(before, after, strict=True) for a, b in zip(x.logprobs, y.logprobs))
        assert changed > 1e-3
        # a request issued with the old handle is still served by the old weights, exactly
        again = await sample_datums(backend, h0, seed=7)
        assert [d.logprobs for d in again] == [d.logprobs for d in before]


@pytest.mark.timeout(60)
async def test_concurrent_requests_are_coalesced_into_one_batch():
    async with make_backend(config(sample_batch_wait_s=0.05)) as backend:
        handle = backend.initial_handle()
        prompt = backend.tokenizer.encode("5+5=")
        params = SamplingParams(max_tokens=3)
        results = await asyncio.gather(*[backend.sampling.sample(handle, prompt, 3, params) for _ in range(10)])
        assert [len(r) for r in results] == [3] * 10
        assert backend.sampling.batches == 1 and backend.sampling.rows == 30


@pytest.mark.timeout(60)
async def test_batches_respect_max_sample_batch():
    async with make_backend(config(max_sample_batch=4)) as backend:
        handle = backend.initial_handle()
        out = await backend.sampling.sample(handle, backend.tokenizer.encode("1+1="), 10, SamplingParams(max_tokens=2))
        assert len(out) == 10 and backend.sampling.batches == 3


@pytest.mark.timeout(60)
async def test_a_seeded_request_samples_the_same_whatever_its_batch():
    async with make_backend(config(sample_batch_wait_s=0.02)) as backend:
        handle, tok = backend.initial_handle(), backend.tokenizer
        params = SamplingParams(max_tokens=5, seed=123)
        alone = await backend.sampling.sample(handle, tok.encode("2+2="), 4, params)
        crowd = await asyncio.gather(
            backend.sampling.sample(handle, tok.encode("123+456="), 4, SamplingParams(max_tokens=5)),
            backend.sampling.sample(handle, tok.encode("2+2="), 4, params),
        )
        assert [s.tokens for s in crowd[1]] == [s.tokens for s in alone]
        flat = [lp for s in crowd[1] for lp in s.logprobs]
        assert flat == pytest.approx([lp for s in alone for lp in s.logprobs], abs=TOL)


@pytest.mark.timeout(60)
async def test_stop_tokens_max_tokens_and_greedy():
    async with make_backend(config()) as backend:
        handle, tok = backend.initial_handle(), backend.tokenizer
        prompt = tok.encode("7+1=")
        everything = tuple(range(tok.vocab_size))
        params = SamplingParams(max_tokens=5, stop_token_ids=everything)
        stopped = await backend.sampling.sample(handle, prompt, 4, params)
        assert all(len(s.tokens) == 1 and s.stop_reason == StopReason.STOP for s in stopped)
        greedy = await backend.sampling.sample(handle, prompt, 3, SamplingParams(max_tokens=4, temperature=0.0))
        assert len({tuple(s.tokens) for s in greedy}) == 1
        top1 = await backend.sampling.sample(handle, prompt, 3, SamplingParams(max_tokens=4, top_k=1))
        tiny_p = await backend.sampling.sample(handle, prompt, 3, SamplingParams(max_tokens=4, top_p=1e-6))
        assert top1[0].tokens == tiny_p[0].tokens == greedy[0].tokens
        for s in greedy:
            assert len(s.tokens) == 4 or s.tokens[-1] == tok.eos_token_id
            assert s.stop_reason == (StopReason.STOP if s.tokens[-1] == tok.eos_token_id else StopReason.LENGTH)


@pytest.mark.timeout(60)
async def test_the_update_is_a_per_token_mean_however_the_step_is_split():
    """All datums in one forward_backward, in two halves, each twice, or in microbatches of 3:
    the same mean gradient.
    (Adam hides a gradient's scale, so the check is on the gradient norm the step reports.)"""
    norms = []
    for layout in ("one call", "two halves", "doubled", "microbatched"):
        async with make_backend(config(microbatch_size=3 if layout == "microbatched" else 0)) as backend:
            datums = await sample_datums(backend, backend.initial_handle(), seed=1)
            calls = {"two halves": [datums[:5], datums[5:]], "doubled": [datums + datums]}.get(layout, [datums])
            futures = [backend.training.forward_backward(c, LossSpec("importance_sampling")) for c in calls]
            step = backend.training.optim_step(AdamParams(learning_rate=1e-3, grad_clip_norm=0.0))
            await asyncio.gather(*futures)
            metrics = (await step).metrics
            assert metrics["optim/step_tokens"] == sum(d.num_loss_tokens for c in calls for d in c)
            norms.append(metrics["optim/grad_norm"])
    assert norms[1:] == pytest.approx([norms[0]] * 3, rel=1e-5)


@pytest.mark.timeout(60)
async def test_calls_return_at_once_and_run_in_submission_order():
    async with make_backend(config()) as backend:
        datums = await sample_datums(backend, backend.initial_handle())
        fb = backend.training.forward_backward(datums, LossSpec("importance_sampling"))
        step = backend.training.optim_step(ADAM)
        pub = backend.training.publish(1)
        fb2 = backend.training.forward_backward(datums, LossSpec("importance_sampling"))
        assert not pub.done()  # submitted, not run yet: the forward_backward is still ahead of it
        first, _, handle, second = await asyncio.gather(fb, step, pub, fb2)
        assert handle.version == 1
        # the second forward ran after the step: its logprobs are the updated weights'
        assert first.logprobs_D != second.logprobs_D


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lora_rank", [0, 4])
async def test_save_load_round_trip_makes_the_next_step_identical(tmp_path, lora_rank):
    async with make_backend(config(tmp_path, lora_rank=lora_rank)) as backend:
        datums = await sample_datums(backend, backend.initial_handle())  # unseeded: advances the seed stream
        await backend.training.forward_backward(datums, LossSpec("ppo"))
        await backend.training.optim_step(ADAM)
        path = await backend.training.save_state("step_000001")
        assert path.startswith(str(tmp_path / "run"))
        await backend.training.forward_backward(datums, LossSpec("ppo"))
        await backend.training.optim_step(ADAM)
        expected = {n: p.detach().clone() for n, p in backend.training.params.items()}
        expected_stream = backend.sampling.unseeded_requests

    # full fine-tuning restores every weight: start from other ones to prove it; a LoRA
    # checkpoint applies to the base its seed builds
    other = config(tmp_path, lora_rank=lora_rank).model_copy(update={"seed": 99 if lora_rank == 0 else 0})
    async with make_backend(other) as backend:
        backend.sampling.unseeded_requests = 12345
        await backend.training.load_state(path)
        assert backend.training.optim_steps == 1
        await backend.training.forward_backward(datums, LossSpec("ppo"))
        await backend.training.optim_step(ADAM)
        for name, value in expected.items():
            assert torch.equal(backend.training.params[name], value), name
        assert backend.sampling.unseeded_requests == expected_stream > 0


@pytest.mark.timeout(60)
async def test_loading_a_checkpoint_of_another_setup_is_refused(tmp_path):
    async with make_backend(config(tmp_path, lora_rank=4)) as backend:
        path = await backend.training.save_state("lora")
    async with make_backend(config(tmp_path)) as backend:
        with pytest.raises(ValueError, match="kind='lora'.*kind='full'|lora_rank"):
            await backend.training.load_state(path)


@pytest.mark.timeout(30)
async def test_describe_and_checkpoint_names():
    async with make_backend(config()) as backend:
        facts = backend.describe()
        assert facts["model"] == "tiny" and facts["device"].startswith(DEVICE) and facts["finetune"] == "full"
        assert facts["trainable_params"] == facts["total_params"] > 0
        with pytest.raises(ValueError, match="plain file name"):
            await backend.training.save_state("../escape")


def test_the_thread_default_leaves_a_core_for_the_event_loop(monkeypatch):
    from headrace.backends.torch.backend import default_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert default_threads("smollm2-135m", "cpu") == 15
    assert default_threads("tiny", "cpu") == 1
    assert default_threads("smollm2-135m", "cuda") == 0  # torch's own
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert default_threads("smollm2-135m", "cpu") == 1  # this machine: two threads ran 10-15x slower
