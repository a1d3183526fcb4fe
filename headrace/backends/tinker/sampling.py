"""Sampling through the sampling client of a published version: all ``n`` samples of a prompt
in one ``sample(..., num_samples=n)`` call; token ids and logprobs straight from Tinker."""

from __future__ import annotations

from typing import Any

from tinker import types

from headrace.backends.tinker import convert
from headrace.backends.tinker.adapters import TinkerSamplerWeights
from headrace.backends.tinker.errors import as_sampling_error
from headrace.core.types import SampledTokens, SamplerHandle, SamplingParams, Tokens


class TinkerSampling:
    def __init__(self, eos_token_id: int, service: Any = None):
        self.eos_token_id = eos_token_id
        self.requests = 0
        self._service = service
        self._clients: dict[str, Any] = {}  # sampler-weights path -> its sampling client (the last few)

    async def _client(self, handle: SamplerHandle) -> Any:
        """The handle's sampling client; a version published as sampler weights for a local sampler
        (``TinkerSamplerWeights``) is sampled through a client of its path, made once."""
        ref = handle.ref
        if not isinstance(ref, TinkerSamplerWeights):
            return ref
        if ref.tinker_path not in self._clients:
            self._clients[ref.tinker_path] = await self._service.create_sampling_client(model_path=ref.tinker_path)
            while len(self._clients) > 8:
                del self._clients[next(iter(self._clients))]
        return self._clients[ref.tinker_path]

    async def sample(
        self, handle: SamplerHandle, prompt: Tokens, n: int, params: SamplingParams
    ) -> list[SampledTokens]:
        client = await self._client(handle)
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
            response = await (await self._client(handle)).sample(
                types.ModelInput.from_ints(list(tokens)),
                num_samples=1,
                sampling_params=types.SamplingParams(max_tokens=1, temperature=1.0),
                topk_prompt_logprobs=k,
            )
        except Exception as e:
            raise as_sampling_error(e) from e
        rows = response.topk_prompt_logprobs or []
        return [[(int(i), float(lp)) for i, lp in (row or [])] for row in rows]
