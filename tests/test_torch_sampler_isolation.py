"""What slips past a server's door fails only the request at fault (issue 22): the torch sampler
tries each request of a coalesced batch that cannot start on its own, and batches the rest again."""

from __future__ import annotations

import asyncio

import pytest

from tests.torch_helpers import config

pytest.importorskip("torch")

from headrace.core.types import SamplingParams  # noqa: E402
from headrace.run.backends import make_backend  # noqa: E402


@pytest.mark.timeout(60)
async def test_a_request_no_generator_takes_fails_alone_not_the_batch_it_was_coalesced_into():
    """Before: a seed of 2**64 (``torch.Generator.manual_seed``) or a top_k of 2**64 (the batch's
    top-k tensor) failed every request coalesced with it."""
    async with make_backend(config(sample_batch_wait_s=0.05)) as backend:
        handle, prompt = backend.initial_handle(), backend.tokenizer.encode("2+2=")
        good = SamplingParams(max_tokens=5, seed=123)
        alone = await backend.sampling.sample(handle, prompt, 3, good)
        results = await asyncio.gather(
            backend.sampling.sample(handle, prompt, 2, SamplingParams(max_tokens=5, seed=2**64)),
            backend.sampling.sample(handle, prompt, 3, good),
            backend.sampling.sample(handle, prompt, 2, SamplingParams(max_tokens=5, top_k=2**64)),
            return_exceptions=True,
        )
        assert isinstance(results[0], Exception) and isinstance(results[2], Exception)
        assert not isinstance(results[1], BaseException)
        assert [s.tokens for s in results[1]] == [s.tokens for s in alone]
        assert backend.sampling.batches == 2  # the good one alone first, then batched again without the others
