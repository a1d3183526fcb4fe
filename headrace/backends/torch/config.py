"""The torch backend's config section, ``[torch]`` / ``--set torch.key=value`` (light: no torch import)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TorchConfig(BaseModel):
    """The ``[torch]`` section: where and how the local PyTorch learner and sampler run."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    dtype: str = Field(
        "auto",
        description="auto | float32 | bfloat16 | float16; auto: bfloat16 for a pretrained model on hardware with "
        "bfloat16 matrix units (AMX or AVX512-BF16 CPUs, CUDA compute capability 8.0+), else float32",
    )
    attention: str = Field(
        "auto",
        description="auto | eager | sdpa: the attention kernel; auto: eager on a CPU (RL's short sequences: "
        "about 1.4x faster a training pass than SDPA's CPU flash kernel), sdpa elsewhere",
    )
    lora_rank: int | None = Field(
        None,
        ge=0,
        description="0 = full fine-tuning; None = the model's default (full for tiny, LoRA 16 for pretrained)",
    )
    lora_alpha: float = Field(32.0, gt=0.0, description="LoRA scaling: the update is multiplied by alpha / rank")
    # attention and MLP, as Tinker trains by default: attention alone learns about half as fast
    # (benchmarks/RESULTS.md, "Measured design choices")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="the modules LoRA adapts",
    )
    sample_batch_wait_s: float = Field(0.002, ge=0.0, description="how long the sampler waits to coalesce requests")
    max_sample_batch: int = Field(256, ge=1, description="most sequences the sampler batches at once")
    num_threads: int = Field(
        0, ge=0, description="CPU threads; 0 = on a CPU every core but one (1 for tiny), on a GPU torch's default"
    )
    microbatch_size: int = Field(
        0, ge=0, description="datums per forward pass; 0 = auto (by tokens: about 2048 a pass)"
    )
    pack: bool = Field(
        True,
        description="cross_entropy (sft, sdft): several datums a row, each attending to itself alone (not padded rows)",
    )
    share_prefix: bool = Field(
        True,
        description="the learner computes a prefix its datums share (a GRPO group's prompt, DPO's pair) once "
        "a pass, each datum's own tokens attending to it, not once per datum",
    )
    decode_step: bool = Field(
        True,
        description="the sampler decodes a bfloat16 or float32 Llama-family model on a CPU with its own "
        "written-out step (stacked projections, KV buffers) rather than transformers' forward; false: "
        "transformers' forward",
    )
    max_nonfinite_skips: int = Field(
        3,
        ge=1,
        description="optimizer steps in a row skipped for a non-finite loss or gradient norm before the run stops",
    )


def model_defaults(section: TorchConfig, model: str) -> TorchConfig:
    """``lora_rank`` unset (None): the model's default (full fine-tuning for 'tiny', LoRA for a
    pretrained model), written into the section so the run's config.json says what ran."""
    if section.lora_rank is not None:
        return section
    from headrace.models import model_spec

    return section.model_copy(update={"lora_rank": model_spec(model).lora_rank})
