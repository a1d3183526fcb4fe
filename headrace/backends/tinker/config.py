"""The tinker backend's config section, ``[tinker]`` / ``--set tinker.key=value`` (light: no SDK import)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TinkerConfig(BaseModel):
    """The ``[tinker]`` section: the service, the LoRA rank and exactly-once recovery."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    base_url: str | None = Field(None, description="defaults to TINKER_BASE_URL or the hosted service")
    lora_rank: int = Field(32, ge=1, description="rank of the LoRA training client")
    tokenizer: str | None = Field(None, description="local tokenizer path (no hub download)")
    # exactly once (headrace/backends/tinker/training.py's docstring): a training call whose outcome is
    # uncertain is re-run on a new training client restored from the last committed state
    commit_every: int = Field(
        10, ge=0, description="save a committed state every N steps; 0 = only the run's checkpoints"
    )
    commit_ttl_s: int | None = Field(86400, ge=3600, description="lifetime of automatic commits on the service")
    merge_forward_backward: bool = Field(
        True,
        description="send a step's forward_backward calls as one request, right ahead of its optim_step (one clock "
        "cycle per step); false: each as it is made",
    )
    request_timeout_s: float = Field(
        900.0, gt=0.0, description="a training call with no result after this long counts as lost"
    )
    max_recoveries: int = Field(3, ge=0, description="consecutive recoveries before the run fails")
    save_sampler_weights: bool = Field(
        True, description="also save sampler weights at each checkpoint (path in the manifest)"
    )
