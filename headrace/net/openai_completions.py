"""The OpenAI (legacy) text completions wire format (``POST /v1/completions``): a prompt as text or
as token ids, continued as it is (no chat template), the text back.

What agents that speak completions send (verifiers' completion-format environments, vLLM-style
clients that pass token ids to keep token in / token out exact).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from headrace.core.types import SamplingParams

from .openai_wire import Answer, ApiError, _int, _number, _stop, _top_k


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]  # text, or token ids as they are
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    logprobs: bool


def parse_completion(body: dict[str, Any], defaults: SamplingParams) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    ids = isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids:
        raise ApiError(
            400, "'prompt' must be a non-empty string or a list of token ids (one prompt a request)", "prompt"
        )
    for key, allowed, why in (("echo", (None, False), "the prompt is not sent back"),
                              ("suffix", (None, ""), "there is no insertion"),
                              ("best_of", (None, 1), "one completion is sampled a request")):  # fmt: skip
        if body.get(key) not in allowed:  # (True == 1: echo's check is the one that needs False)
            raise ApiError(400, f"'{key}' is not supported: {why}", key)
    if body.get("n", 1) != 1:
        raise ApiError(400, f"n = {body['n']!r}: one completion per request is served here", "n")
    logprobs = _int(body, "logprobs", 0, 0)
    if logprobs > 1:
        raise ApiError(400, "'logprobs' above 1 is not supported: the sampler keeps only the drawn token's", "logprobs")
    params = SamplingParams(
        max_tokens=_int(body, "max_tokens", defaults.max_tokens, 1),
        temperature=_number(body, "temperature", defaults.temperature, 0.0, 2.0),
        top_p=_number(body, "top_p", defaults.top_p, 0.0, 1.0, open_low=True),
        top_k=_top_k(body, defaults.top_k),
    )
    return CompletionRequest(prompt, params, _stop(body.get("stop")), bool(body.get("stream")), bool(logprobs))  # type: ignore[arg-type]


def text_completion_body(
    cid: str, model: str, version: int, ans: Answer, prompt_tokens: int, tokens: list[str] | None = None
) -> dict[str, Any]:
    """``tokens``: each answer token's text, when logprobs were asked for."""
    logprobs = None
    if tokens is not None:
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        logprobs = {"tokens": tokens, "token_logprobs": ans.logprobs[: len(tokens)], "top_logprobs": None,
                    "text_offset": offsets}  # fmt: skip
    return {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "policy_version": version,
        "choices": [{"index": 0, "text": ans.text, "logprobs": logprobs, "finish_reason": ans.finish_reason}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(ans.tokens),
            "total_tokens": prompt_tokens + len(ans.tokens),
        },
    }


def text_stream_body(body: dict[str, Any]) -> bytes:
    choice = body["choices"][0]
    base = {k: body[k] for k in ("id", "object", "created", "model", "policy_version")}
    events = [
        {**base, "choices": [{**choice, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}],
         "usage": body["usage"]},
    ]  # fmt: skip
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"
