"""What the emulator refuses at the door, before any work: ``ClientError`` (a status and a
message the server answers with), the base-model names it answers to, and a sample request's
options.

Base-model names (``ServedNames``): the emulator answers to every name a client asks for and
computes it with the ``--model`` of that name, or else with its first ``--model``; so the
Tinker cookbook asking for ``Qwen/Qwen3-8B`` trains the embedded tiny model. ``--serve-only
NAME...`` restricts the names it answers to (a 400 naming them for any other).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from headrace.core.errors import RequestError
from headrace.tinker_emulator.compute import Compute, SampleSpec


class ClientError(RequestError):
    """A request refused before any work: answered with ``status`` and the message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class ServedNames:
    """The base-model names the emulator answers to, and the model that computes each."""

    def __init__(self, models: list[str], serve_only: tuple[str, ...] | list[str] = ()):
        self.models, self.serve_only = list(models), tuple(serve_only)

    def computed_by(self, name: str) -> str:
        """The served model of that name, else the first (the default)."""
        return name if name in self.models else self.models[0]

    def resolve(self, name: str) -> str:
        """``computed_by``, for a name the emulator answers to; a 400 naming those it does, for another."""
        if not isinstance(name, str) or not name:
            raise ClientError(400, f"base_model must be a model name, got {name!r}")
        if self.serve_only and name not in self.serve_only:
            raise ClientError(
                400,
                f"base model '{name}' is not served by this Tinker emulator, which serves: "
                f"{', '.join(self.serve_only)} (--serve-only). Start it with `headrace tinker-emulator --model {name}` "
                "to compute with that model, or without --serve-only to answer to every name; or run with one of "
                "those as --model.",
            )
        return self.computed_by(name)

    def capabilities(self, compute: Compute) -> dict[str, Any]:
        """``get_server_capabilities``: the names answered to, each with the model computing it. The
        SDK's ``SupportedModel`` has a name and no wildcard, so "any name" is an entry named
        ``* (any base model name; computed by M)``; the extra keys are for people and tests
        reading the JSON (the SDK ignores them)."""

        def entry(name: str) -> dict[str, Any]:
            model = self.computed_by(name)
            return {
                "model_name": name,
                "max_context_length": compute.max_context(model),
                "trainable": True,
                "sampleable": True,
                "computed_by": model,
                "vocab_size": compute.vocab_size(model),
            }

        if self.serve_only:
            return {"supported_models": [entry(n) for n in self.serve_only], "any_base_model": False}
        listed = [entry(m) for m in self.models]
        wildcard = entry(self.models[0]) | {"model_name": f"* (any base model name; computed by {self.models[0]})"}
        return {"supported_models": [*listed, wildcard], "any_base_model": True}


UNSERVED_SAMPLE_OPTIONS = {
    "topk_sample_logprobs": "top-k logprobs of the sampled tokens",
    "target_prompt_logprobs": "logprobs of chosen prompt token ids",
    "prompt_alt_tokens_k": "alternative prompt tokens",
}


def prompt_logprob_options(body: dict[str, Any], prompt_len: int) -> tuple[bool, int, int | None]:
    """(prompt logprobs?, top-k prompt logprobs k, score only the last N) of a sample request; a
    ``ClientError`` for what the emulator does not compute, or a value the service refuses."""
    for name, what in UNSERVED_SAMPLE_OPTIONS.items():
        if body.get(name):
            raise ClientError(
                400,
                f"the Tinker emulator does not compute {what} ({name}={body[name]!r}); it serves prompt logprobs "
                "(include_prompt_logprobs) and top-k prompt logprobs (topk_prompt_logprobs)",
            )
    want, topk, last_n = bool(body.get("prompt_logprobs")), body.get("topk_prompt_logprobs") or 0, None
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 0:
        raise ClientError(400, f"topk_prompt_logprobs must be a non-negative integer, got {topk!r}")
    if body.get("prompt_logprobs_last_n") is not None:
        last_n = body["prompt_logprobs_last_n"]
        if not want:
            raise ClientError(400, "prompt_logprobs_last_n applies to prompt logprobs; set include_prompt_logprobs")
        if not isinstance(last_n, int) or isinstance(last_n, bool) or not 1 <= last_n <= prompt_len - 1:
            raise ClientError(
                400, f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {prompt_len - 1}, got {last_n!r}"
            )
    return want, topk, last_n


def sample_spec(sp: dict[str, Any]) -> SampleSpec:
    """The sampling parameters as sent; ``ValueError`` (a 400) for a ``stop`` of the wrong shape."""
    stop = sp.get("stop")
    stop_tokens: tuple[int, ...] | None = None  # the model's own EOS
    stop_strings: tuple[str, ...] = ()
    shape = f"sampling_params.stop must be a string, a list of strings or a list of token ids, not {stop!r}"
    if isinstance(stop, str):
        stop_strings = (stop,)
    elif isinstance(stop, list | tuple):
        if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
            stop_tokens = tuple(stop)  # [] turns EOS off too
        elif all(isinstance(s, str) for s in stop):
            stop_strings = tuple(stop)
        else:
            raise ValueError(shape)
    elif stop is not None:
        raise ValueError(shape)
    if any(not s for s in stop_strings):
        raise ValueError("sampling_params.stop holds an empty string, which would stop every sample at once")
    return SampleSpec(
        _integer(sp, "max_tokens", 16, 1, INT32_MAX),
        _number(sp, "temperature", 1.0, 0.0, math.inf),
        _integer(sp, "top_k", -1, -1, INT32_MAX),  # -1 and 0: no cut
        _number(sp, "top_p", 1.0, 0.0, 1.0),
        stop_tokens,
        stop_strings,
        _integer(sp, "seed", None, 0, INT64_MAX),
    )


INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
_BOUNDS = {INT32_MAX: "2**31 - 1", INT64_MAX: "2**63 - 1"}


def _integer(sp: dict[str, Any], key: str, default: Any, low: int, high: int) -> Any:
    """``sampling_params[key]``, an integer within what every compute holds (a seed beyond 64 bits
    no generator takes); ``ValueError`` (a 400) naming the field and its range."""
    value = sp.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:20]}... ({len(repr(value))} characters)"
        raise ValueError(f"sampling_params.{key} must be an integer from {low} to {_BOUNDS[high]}, got {shown}")
    return value


def _number(sp: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = sp.get(key)
    if value is None:
        return default
    number = math.nan
    if isinstance(value, int | float) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an integer beyond any float
            number = float(value)
    if not (math.isfinite(number) and low <= number <= high):
        raise ValueError(f"sampling_params.{key} must be a finite number from {low:g} to {high:g}, got {value!r}"[:300])
    return number
