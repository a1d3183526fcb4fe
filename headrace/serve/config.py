"""``serve.*``: the options of ``headrace serve`` (``headrace/serve/``), a section of the run config
so one TOML file, ``--set serve.key=value`` and ``config.json`` hold them beside the backend's.
The run config knows it by name only (``registry.sections``), as it knows a backend's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from headrace.run.config import RunConfig


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    host: str = Field("127.0.0.1", description="bind address (loopback by default)")
    port: int = Field(8000, ge=0, le=65535, description="port; 0 = pick a free one")
    token_env: str = Field("HEADRACE_API_TOKEN", description="the environment variable holding the bearer token")
    no_auth: bool = Field(False, description="serve without a token (only on a loopback address)")
    model_name: str | None = Field(None, description="the name /v1/models lists; None = --model")
    batch_size: int = Field(8, ge=1, description="scored completions of the incumbent that train one candidate")
    max_staleness: int = Field(
        0, ge=0, description="publishes a completion may lag and still be trained on; 0 = the incumbent's only"
    )
    baseline_decay: float = Field(
        0.9,
        ge=0.0,
        lt=1.0,
        description="a scenario's running reward baseline: new = decay x old + (1 - decay) x reward",
    )
    per_scenario: bool = Field(
        False,
        description="each scenario (x-headrace-scenario or metadata.scenario) its own chain, candidates, gate "
        "and rollback, on one base model",
    )
    gate: Literal["always", "env"] = Field("always", description="publish every candidate, or gate it on an env")
    gate_env: str | None = Field(None, description="gate = env: the env whose held-out problems score a candidate")
    gate_env_options: dict[str, Any] = Field(
        default_factory=lambda: {"split": "test"}, description="options of gate_env"
    )
    gate_problems: int = Field(16, ge=1, description="held-out problems per gate evaluation")
    gate_samples: int = Field(
        1, ge=1, description="seeded samples per gate problem, the same seeds for candidate and incumbent"
    )
    gate_temperature: float = Field(
        0.0, ge=0.0, le=2.0, description="the gate's sampling temperature; 0 = greedy (then gate_samples 1 suffices)"
    )
    gate_min_reward: float | None = Field(
        None, description="publish only if the candidate's mean reward is at least this"
    )
    gate_improve: bool = Field(
        False,
        description="publish only if a paired sign test shows the candidate better than the incumbent "
        "(false-accept rate at most gate_alpha)",
    )
    gate_no_regress: bool = Field(
        False, description="publish unless a paired sign test shows the candidate worse than the incumbent"
    )
    gate_alpha: float = Field(
        0.05, gt=0.0, lt=0.5, description="the paired test's level: gate_improve's false-accept rate"
    )
    max_context: int | None = Field(
        None, ge=1, description="prompt + max_tokens limit; None = the sampler's own (the model's positions)"
    )
    max_concurrency: int = Field(256, ge=1, description="requests sampled at once; the rest wait in line")
    # the HTTP server's limits (headrace/net/limits.py), as the Tinker emulator's knobs of the same names
    max_connections: int = Field(
        1024, ge=1, description="connections served at once (fewer if ulimit -n leaves room for fewer); past it, 503"
    )
    idle_connection_s: float = Field(
        30.0, ge=0, allow_inf_nan=False, description="a keep-alive connection with no request this long is closed"
    )
    header_timeout_s: float = Field(
        10.0, ge=0, allow_inf_nan=False, description="a request's line and headers must arrive within this (s)"
    )
    max_body_mib: float = Field(32.0, gt=0, allow_inf_nan=False, description="a larger request body is answered 413")

    @model_validator(mode="after")
    def _gate_env_named(self) -> ServeConfig:
        if self.gate == "env" and not self.gate_env:
            raise ValueError("serve.gate = 'env' needs serve.gate_env (the env whose held-out problems gate)")
        if self.gate == "env" and self.gate_min_reward is None and not (self.gate_no_regress or self.gate_improve):
            raise ValueError(
                "serve.gate = 'env' needs a rule: serve.gate_improve = true, serve.gate_no_regress = true "
                "and/or serve.gate_min_reward"
            )
        return self


def serve_options(config: RunConfig) -> ServeConfig:
    """``config``'s ``[serve]`` section: what it sets, else the defaults."""
    options: ServeConfig = config.section("serve")
    return options
