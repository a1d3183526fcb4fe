"""``sft.*`` and ``dpo.*``: sections of the run config (``registry.sections``), so one TOML file,
``--set sft.key=value`` and ``config.json`` hold them beside the backend's."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DataOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    data: str | None = Field(None, description="a JSONL or Parquet file of examples (--data)")
    test_data: str | None = Field(None, description="held-out examples; None = test_fraction of data")
    test_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="examples held out of data when no test_data")
    max_test: int = Field(64, ge=0, description="held-out examples scored at each evaluation, at most")
    batch_tokens: int = Field(2048, ge=1, description="tokens per step, at most (a longer example is a step alone)")
    epochs: float = Field(1.0, gt=0.0, description="passes over the data; the run stops here or at --steps, the first")
    eval_every: int = Field(
        0, ge=0, description="held-out loss every N steps (and at the start and end); 0 = ends only"
    )
    max_length: int = Field(2048, ge=2, description="tokens per example; longer ones are cut (their end dropped)")
    env: str | None = Field(None, description="an env whose held-out accuracy is measured at the start and end (--env)")


class SFTConfig(DataOptions):
    train_on: Literal["all_assistant", "last_assistant"] = Field(
        "all_assistant", description="which assistant turns carry the loss (the rest are context)"
    )


class DPOConfig(DataOptions):
    batch_tokens: int = Field(4096, ge=1, description="tokens per step (chosen + rejected), at most")
    beta: float = Field(0.1, gt=0.0, description="the DPO temperature: how far from the reference the policy may go")


class SDFTConfig(DataOptions):
    batch_tokens: int = Field(1024, ge=1, description="prompt + demonstration tokens per step, at most")
    top_k: int = Field(8, ge=1, description="the teacher's likeliest next tokens the student is trained toward")
    samples: int = Field(1, ge=1, description="the student's samples per prompt each step")
    teacher_sync_every: int = Field(
        0,
        ge=0,
        description="0: the teacher is the starting weights, frozen; N: the current weights, taken every N steps",
    )
    teacher_template: str = Field(
        "{prompt}\n\nThis is an example of a response to the question:\n{demonstration}\n\n"
        "Now answer with a response of your own.",
        description="the teacher's last user turn: {prompt} (the student's) and {demonstration} (the assistant turn)",
    )
