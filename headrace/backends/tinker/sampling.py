"""Sampling through the sampling client of a published version: all ``n`` samples of a prompt
in one ``sample(..., num_samples=n)`` call; token ids and logprobs straight from Tinker."""

from __future__ import annotations

from tinker import types

from headrace.backends.tinker import convert
from headrace.backends.tinker.errors import as_sampling_error
from headrace.core.types import SampledTokens, SamplerHandle, SamplingParams, Tokens


class TinkerSampling:
    def __init__(self, eos_token_id: int):
        self.eos_token_id = eos_token_id
        self.requests = 0

    async def sample(
        self, handle: SamplerHandle, prompt: Tokens, n: int, params: SamplingParams
    ) -> list[SampledTokens]:
        client = handle.ref
        self.requests += 1
        try:
            response = await client.sample(
                types.ModelInput.from_ints(list(prompt)),
                num_samples=n,
                sampling_params=convert.sampling_params(params, self.eos_token_id),
            )
        except Exception as e:
            raise as_sampling_error(e) from e
        samples = convert.sampled(response)
        if len(samples) != n:
            raise ValueError(f"Tinker returned {len(samples)} samples, {n} were asked for")
        return samples

    async def topk_logprobs(self, handle: SamplerHandle, tokens: Tokens, k: int) -> list[list[tuple[int, float]]]:
        """Each position's ``k`` likeliest next tokens (``ScoresTopK``): the sampling client's
        ``topk_prompt_logprobs`` of ``tokens`` as the prompt (one token sampled and dropped)."""
        self.requests += 1
        try:
            response = await handle.ref.sample(
                types.ModelInput.from_ints(list(tokens)),
                num_samples=1,
                sampling_params=types.SamplingParams(max_tokens=1, temperature=1.0),
                topk_prompt_logprobs=k,
            )
        except Exception as e:
            raise as_sampling_error(e) from e
        rows = response.topk_prompt_logprobs or []
        return [[(int(i), float(lp)) for i, lp in (row or [])] for row in rows]
