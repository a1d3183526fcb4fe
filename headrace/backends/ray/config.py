"""``[ray]``: where ``--cluster ray`` puts a run's parts: rollout workers, sampler replicas and the
learner in Ray actors (``headrace/backends/ray/``). The older form of these keys, ``cluster.*``
beside ``cluster.kind``, is still read (``RunConfig`` moves them here)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    address: str = Field("local", description="'local' starts a Ray instance on loopback; else a Ray address")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a local Ray instance; None = the machine's")
    rollout_workers: int = Field(2, ge=1, description="processes that build and step the envs")
    sampler_replicas: int = Field(1, ge=1, description="processes that each hold the weights and sample")
    learner_processes: int = Field(1, ge=1, description="data-parallel learner processes (torch.distributed, gloo)")
    episodes_per_worker: int = Field(256, ge=1, description="env calls a rollout worker runs at once")
