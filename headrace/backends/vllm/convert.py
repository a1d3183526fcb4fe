"""headrace's sampling parameters to vLLM's and back: plain data, no vLLM import.

Conventions shared with the torch sampler (``headrace/backends/torch/generate.py``):

- a sample stops at ``params.stop_token_ids`` plus the model's own stop ids (EOS and the
  generation config's), which the stop token itself ends up in the action; nothing else stops
  it (vLLM's own EOS handling is switched off with ``ignore_eos`` so both samplers agree);
- each token's logprob is ``log_softmax(logits)`` at temperature 1 without top-k/top-p: what
  the learner's forward pass computes (vLLM's ``logprobs_mode="raw_logprobs"``);
- ``seed`` makes a request reproducible; its n samples use seeds ``seed, seed+1, …`` (vLLM's
  rule for ``n > 1``). It is sent only with ``seeded=True`` (``vllm.seed_requests``): otherwise
  the engine's own generator, seeded once with the run seed, draws the samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from headrace.core.errors import BackendError
from headrace.core.types import SampledTokens, SamplingParams, StopReason, Tokens


class ContextOverflowError(BackendError, ValueError):
    """The prompt leaves no room for a single new token within ``vllm.max_model_len``."""


def room_for(prompt: Tokens, max_tokens: int, max_model_len: int) -> int:
    """How many tokens a sample may have: ``max_tokens`` clipped to the context left."""
    room = max_model_len - len(prompt)
    if room < 1:
        raise ContextOverflowError(
            f"the prompt has {len(prompt)} tokens and vllm.max_model_len is {max_model_len}: no room to sample; "
            "raise vllm.max_model_len (and the model's max_position_embeddings) or shorten the prompt"
        )
    return min(max_tokens, room)


def request_n(params: SamplingParams, n: int) -> int:
    """How many samples to ask vLLM for: greedy sampling (temperature 0) is deterministic and
    vLLM refuses ``n > 1`` for it, so one sample is asked for and repeated ``n`` times."""
    return 1 if params.temperature == 0 else n


def stop_ids(params: SamplingParams, model_stops: Iterable[int]) -> list[int]:
    return sorted({*params.stop_token_ids, *model_stops})


def engine_kwargs(
    params: SamplingParams, n: int, max_tokens: int, stops: Sequence[int], *, seeded: bool = True
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` (the in-process engine); ``params.seed`` only
    if ``seeded``."""
    return {
        "n": n,
        "max_tokens": max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": max(0, params.top_k),  # 0 = off in vLLM, -1 = off in headrace
        "seed": params.seed if seeded else None,
        "stop_token_ids": list(stops),
        "ignore_eos": True,
        "logprobs": 0,  # the sampled token's own logprob only
        "detokenize": False,
        "skip_special_tokens": False,
    }


def completion_request(
    model: str,
    prompt: Tokens,
    params: SamplingParams,
    n: int,
    max_tokens: int,
    stops: Sequence[int],
    *,
    seeded: bool = True,
) -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions`` with token ids in and token ids + logprobs out;
    ``params.seed`` only if ``seeded``."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt),  # a list of ints is a pre-tokenised prompt
        "n": n,
        "max_tokens": max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": max(0, params.top_k),
        "stop_token_ids": list(stops),
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,  # choice.token_ids: the ids themselves, no detokenise/retokenise
        "return_tokens_as_token_ids": True,  # logprobs.tokens as "token_id:N", for a cross-check
        "skip_special_tokens": False,
        "stream": False,
    }
    if seeded and params.seed is not None:
        body["seed"] = params.seed
    return body


def stop_reason(finish_reason: str | None) -> StopReason:
    if finish_reason == "stop":
        return StopReason.STOP
    if finish_reason == "length":
        return StopReason.LENGTH
    raise RuntimeError(f"vLLM ended a sample with finish_reason={finish_reason!r} (aborted or failed)")


def from_engine_output(output: Any) -> SampledTokens:
    """A ``vllm.CompletionOutput`` (``logprobs=0``) as headrace's ``SampledTokens``."""
    tokens = list(output.token_ids)
    if output.logprobs is None:
        raise RuntimeError("vLLM returned no logprobs; the request must ask for logprobs=0")
    logprobs = [_logprob_of(position, token) for position, token in zip(output.logprobs, tokens, strict=True)]
    return SampledTokens(tokens, logprobs, stop_reason(output.finish_reason))


def _logprob_of(position: Mapping[int, Any], token: int) -> float:
    entry = position[token]
    return float(getattr(entry, "logprob", entry))


def from_completion_choice(choice: Mapping[str, Any]) -> SampledTokens:
    """One choice of an OpenAI completions response (see :func:`completion_request`)."""
    tokens = choice.get("token_ids")
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs")
    if tokens is None or values is None:
        raise RuntimeError(
            "the vLLM server returned no token ids or logprobs; it must be vLLM's OpenAI server "
            "(return_token_ids and logprobs are vLLM extensions of the completions API)"
        )
    named = logprobs.get("tokens")
    if named is not None and named != [f"token_id:{t}" for t in tokens]:
        raise RuntimeError("the vLLM server's logprob tokens disagree with its token ids")
    if len(values) != len(tokens):
        raise RuntimeError(f"the vLLM server returned {len(tokens)} tokens but {len(values)} logprobs")
    return SampledTokens(list(tokens), [float(v) for v in values], stop_reason(choice.get("finish_reason")))


def lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    for slot in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= slot:
            return slot
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank (512)")
