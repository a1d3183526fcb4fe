"""The typed run configuration: defaults, a TOML file, dotted overrides, one clear error.

Precedence: defaults < ``--config FILE`` < named flags (``--steps``) < ``--set a.b=value``.
"""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from headrace.core.types import LOSS_NAMES


class ConfigError(ValueError):
    """A configuration the engine refuses; the message names the problem and the fix."""


MAX_SEED = 2**32 - 1
MAX_CONFIG_BYTES = 16 * 2**20  # a bigger --config is a wrong file (a checkpoint, a dataset)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SamplingConfig(_Section):
    max_tokens: int = Field(4, ge=1, description="most tokens per action")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1 = no top-k")


class OptimConfig(_Section):
    learning_rate: float = Field(3e-4, gt=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip_norm: float = Field(1.0, ge=0.0, description="0 = no clipping")


class LossConfig(_Section):
    name: str = Field("importance_sampling", description="importance_sampling | ppo | cispo | cross_entropy")

    @field_validator("name")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        if name not in LOSS_NAMES:
            raise ValueError(
                f"unknown loss '{name}'; valid losses: {', '.join(LOSS_NAMES)}{_closest(name, list(LOSS_NAMES))}"
            )
        return name

    clip_low_threshold: float = Field(0.8, ge=0.0, description="ppo/cispo ratio lower bound")
    clip_high_threshold: float = Field(1.2, gt=0.0, description="ppo/cispo ratio upper bound")


class AdvantageConfig(_Section):
    normalize_std: bool = Field(True, description="divide advantages by the group's reward std")
    filter_constant: bool = Field(True, description="drop groups whose rewards are all equal")


class RetryConfig(_Section):
    budget: int = Field(3, ge=0, description="retries shared by the members of one group")
    rollout_timeout_s: float | None = Field(None, gt=0.0, description="per-rollout timeout")
    max_consecutive_dropped: int = Field(20, ge=1, description="stop the run after this many dropped groups in a row")
    partial_groups: bool = Field(False, description="train a group with its surviving members when the budget runs out")
    backoff_attempts: int = Field(6, ge=1, description="tries in all of a backend call failing transiently")
    backoff_initial_s: float = Field(0.05, ge=0.0, description="first wait before retrying it; doubles each time")
    backoff_max_s: float = Field(5.0, ge=0.0, description="longest wait between its tries")


class SimConfig(_Section):
    """The sim backend's latency model (seconds). Deterministic given the run seed."""

    sample_request_s: float = Field(0.0, ge=0.0, description="fixed cost per sample request")
    sample_token_s: float = Field(0.0, ge=0.0, description="cost per sampled token")
    sample_concurrency: int = Field(64, ge=1, description="most sample requests served at once")
    sample_jitter: float = Field(0.0, ge=0.0, description="lognormal sigma on sample latency")
    train_token_s: float = Field(0.0, ge=0.0, description="forward_backward cost per datum token")
    train_step_s: float = Field(0.0, ge=0.0, description="fixed cost per forward_backward call")
    optim_step_s: float = Field(0.0, ge=0.0, description="cost per optimizer step")
    clock_cycle_s: float = Field(0.0, ge=0.0, description="Tinker-style lock-step cycle; 0 = off")
    action_tokens: int = Field(0, ge=0, description="fixed action length in tokens; 0 = 1-2 digits and an end token")
    length_sigma: float = Field(0.0, ge=0.0, description="lognormal sigma on action length (a long tail)")
    max_context: int = Field(0, ge=0, description="context length the sim claims; 0 = unlimited")
    record_limit: int = Field(
        10_000, ge=0, description="newest calls kept in the sim's timelines (memory stays bounded)"
    )
    sample_fail_rate: float = Field(
        0.0, ge=0.0, le=1.0, description="fault injection: share of sample calls failing transiently"
    )
    sample_fatal_rate: float = Field(
        0.0, ge=0.0, le=1.0, description="fault injection: share of sample calls failing for good"
    )
    train_fail_rate: float = Field(
        0.0, ge=0.0, le=1.0, description="fault injection: share of training submissions refused transiently"
    )


class CheckpointConfig(_Section):
    """Local checkpoints beyond these are deleted; a remote backend's (Tinker's) are all kept."""

    every: int = Field(0, ge=0, description="checkpoint every N steps (--save-every); 0 = only at the end")
    keep_last: int = Field(3, ge=0, description="keep the newest N checkpoints; 0 = all")
    keep_every: int = Field(0, ge=0, description="also keep every checkpoint whose step is a multiple of N; 0 = none")


class EvalConfig(_Section):
    """Held-out evaluation during training (``headrace/core/evaluate.py``)."""

    every: int = Field(0, ge=0, description="evaluate every N steps, at the start and at the end; 0 = off")
    env: str | None = Field(None, description="the env to evaluate; None = the run's env")
    env_options: dict[str, Any] = Field(
        default_factory=lambda: {"split": "test"},
        description="the eval env's options; for the run's own env, merged over the run's env_options",
    )
    problems: int = Field(32, ge=1, description="held-out problems per evaluation")
    samples: int = Field(1, ge=1, description="samples per problem (k of pass@k)")
    greedy: bool = Field(True, description="sample each problem's first answer at temperature 0")
    max_concurrency: int = Field(8, ge=1, description="most eval episodes running at once")
    final_timeout_s: float = Field(600.0, gt=0.0, description="how long the last step waits for its evaluation")


class TorchConfig(_Section):
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    dtype: str = Field("float32", description="float32 | bfloat16 | float16")
    lora_rank: int | None = Field(
        None,
        ge=0,
        description="0 = full fine-tuning; None = the model's default (full for tiny, LoRA 16 for pretrained)",
    )
    lora_alpha: float = Field(32.0, gt=0.0)
    # attention and MLP, as Tinker trains by default: attention alone learns about half as fast
    # (benchmarks/RESULTS.md, "Measured design choices")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    sample_batch_wait_s: float = Field(0.002, ge=0.0, description="how long the sampler waits to coalesce requests")
    max_sample_batch: int = Field(256, ge=1)
    num_threads: int = Field(0, ge=0, description="CPU threads; 0 = 1 for tiny, else torch default")
    microbatch_size: int = Field(
        0, ge=0, description="datums per forward pass; 0 = auto (by tokens: about 2048 a pass)"
    )
    max_nonfinite_skips: int = Field(
        3,
        ge=1,
        description="optimizer steps in a row skipped for a non-finite loss or gradient norm before the run stops",
    )


class TinkerConfig(_Section):
    base_url: str | None = Field(None, description="defaults to TINKER_BASE_URL or the hosted service")
    lora_rank: int = Field(32, ge=1)
    tokenizer: str | None = Field(None, description="local tokenizer path (no hub download)")
    # exactly once (headrace/backends/tinker/training.py's docstring): a training call whose outcome is
    # uncertain is re-run on a new training client restored from the last committed state
    commit_every: int = Field(
        10, ge=0, description="save a committed state every N steps; 0 = only the run's checkpoints"
    )
    commit_ttl_s: int | None = Field(86400, ge=3600, description="lifetime of automatic commits on the service")
    request_timeout_s: float = Field(
        900.0, gt=0.0, description="a training call with no result after this long counts as lost"
    )
    max_recoveries: int = Field(3, ge=0, description="consecutive recoveries before the run fails")
    save_sampler_weights: bool = Field(
        True, description="also save sampler weights at each checkpoint (path in the manifest)"
    )


class VllmConfig(_Section):
    sampler_url: str | None = Field(None, description="OpenAI-compatible vLLM server; None = in-process engine")
    gpu_memory_utilization: float = Field(
        0.2, gt=0.0, le=1.0, description="share of device memory (CPU: of RAM) for weights and KV cache"
    )
    max_model_len: int = Field(256, ge=8, description="longest prompt + sample; samples are cut to fit")
    dtype: str = Field("auto", description="auto (= torch.dtype) | float32 | bfloat16 | float16")
    max_num_seqs: int = Field(256, ge=1, description="most sequences the engine batches at once")
    max_loras: int = Field(
        4, ge=1, description="LoRA versions the engine holds at once (async runs sample from several)"
    )
    enforce_eager: bool | None = Field(None, description="no CUDA graphs / torch.compile; None = only on CPU")
    enable_prefix_caching: bool = True
    workdir: str | None = Field(
        None, description="where versions are saved for vLLM; a server must see it at the same path"
    )
    served_model: str | None = Field(None, description="server mode: the base model name; None = the server's first")
    request_timeout_s: float = Field(600.0, gt=0.0, description="server mode: per request")
    server_ready_timeout_s: float = Field(
        120.0, ge=0.0, description="server mode: how long to wait for /health at start"
    )


class RunConfig(_Section):
    env: str = "arithmetic"
    env_options: dict[str, Any] = Field(default_factory=dict, description="passed to the env factory")
    scheduler: str = "sync"
    backend: str = "torch"
    sampler: str | None = Field(None, description="sampling backend if not the backend's own (e.g. vllm)")
    model: str = Field("tiny", description="'tiny' (embedded), a Hugging Face name, or a local directory")
    log_rollouts: int = Field(
        8, ge=0, description="trajectories per step written to RUN_DIR/rollouts/ for `headrace view` (0 = none)"
    )
    renderer: str | None = Field(None, description="chat_template | role_colon | tiny; None = the model's default")
    steps: int = Field(120, ge=1)
    batch_size: int = Field(32, ge=1, description="groups per step")
    group_size: int = Field(16, ge=1, description="samples per problem")
    num_minibatches: int = Field(4, ge=1, description="stream: forward_backward calls per step")
    max_steps_off_policy: int = Field(1, ge=0, description="async: how far sampling may run ahead")
    rollout_workers: int | None = Field(None, ge=1, description="concurrent groups; default: every admitted group")
    max_turns: int = Field(16, ge=1)
    # every backend seeds numpy, torch or vLLM with it, and numpy takes 0..2**32-1 only
    seed: int = Field(0, description="random seed, 0 to 2**32-1")
    run_dir: str | None = None
    resume: bool = False
    overwrite: bool = False
    pipeline: bool = Field(True, description="learner submits calls before awaiting earlier ones")
    progress: bool = True
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    advantages: AdvantageConfig = Field(default_factory=AdvantageConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sim: SimConfig = Field(default_factory=SimConfig)
    torch: TorchConfig = Field(default_factory=TorchConfig)
    tinker: TinkerConfig = Field(default_factory=TinkerConfig)
    vllm: VllmConfig = Field(default_factory=VllmConfig)

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, seed: int) -> int:
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(
                f"the seed must be between 0 and {MAX_SEED} (2**32-1), the range every backend's "
                "random generator takes; pick a seed in it"
            )
        return seed

    @model_validator(mode="before")
    @classmethod
    def _legacy_save_every(cls, data: Any) -> Any:
        """``save_every`` is ``checkpoint.every`` now; older config files and run directories
        (their config.json) still say ``save_every``."""
        if isinstance(data, dict) and "save_every" in data:
            data = dict(data)
            every = data.pop("save_every")
            data["checkpoint"] = {"every": every, **(data.get("checkpoint") or {})}
        return data

    @model_validator(mode="after")
    def _check_minibatches(self) -> RunConfig:
        if self.scheduler == "stream" and self.batch_size % self.num_minibatches:
            raise ValueError(
                f"batch_size={self.batch_size} does not split into num_minibatches={self.num_minibatches}; "
                "pick a batch size that is a multiple of the number of minibatches"
            )
        return self


def _closest(name: str, choices: list[str], prefix: str = "") -> str:
    match = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean '{prefix}{match[0]}'?)" if match else ""


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set '{dotted}': '{part}' is a value, not a section")
    node[leaf] = value


def _parse_value(raw: str) -> Any:
    """Command-line values are TOML literals where they parse as one, else plain strings."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        if (size := p.stat().st_size) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"config file '{p}' is {size / 2**20:.0f} MiB, not a config; check that it is the right file"
            )
        # utf-8-sig: a byte-order mark, as some editors write, is not an error
        return tomllib.loads(p.read_bytes().decode("utf-8-sig"))
    except FileNotFoundError:
        raise ConfigError(f"config file '{p}' does not exist; pass a TOML file to --config") from None
    except IsADirectoryError:
        raise ConfigError(f"config file '{p}' is a directory; pass a TOML file to --config") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file '{p}': {e.strerror or e}. Pass a readable TOML file.") from None
    except UnicodeDecodeError as e:
        # a binary file (a checkpoint, an executable) or another encoding: TOML is UTF-8 text
        raise ConfigError(
            f"config file '{p}' is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}): "
            "a TOML file must be UTF-8. Check that it is the right file, or re-save it as UTF-8."
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file '{p}' is not valid TOML: {e}. Fix the line it names.") from None


def build_config(
    file: str | Path | None = None,
    flags: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> RunConfig:
    """Merge defaults, a TOML file, flags and ``key.sub=value`` overrides into a checked config.
    ``base`` (a resumed run's saved options) sits between the defaults and the file."""
    tree: dict[str, Any] = _merged(base or {}, load_toml(file) if file else {})
    for key, value in (flags or {}).items():
        if value is not None:
            _set_dotted(tree, key, value)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' has no '='; write it as key=value, e.g. sampling.temperature=0.7")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), _parse_value(raw.strip()))
    return validate(tree)


def _merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def validate(tree: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_explain(e)) from None


def _explain(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "config"
        if item["type"] == "extra_forbidden":
            section: type[BaseModel] = RunConfig
            for part in item["loc"][:-1]:
                field = section.model_fields.get(str(part))
                if field is None or not isinstance(field.annotation, type):
                    break
                section = field.annotation
            prefix = "".join(f"{p}." for p in item["loc"][:-1])
            valid = list(section.model_fields)
            # nothing close (e.g. 'lr'): the section's options are a short list
            hint = _closest(str(item["loc"][-1]), valid, prefix) or f" (valid here: {', '.join(sorted(valid))})"
            lines.append(f"unknown option '{where}'{hint}")
        else:
            msg = item["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg} (got {item.get('input')!r})")
    return "invalid configuration: " + "; ".join(lines) + ". See `headrace run --help` for every option."
