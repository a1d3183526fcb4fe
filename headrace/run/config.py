"""The typed run configuration: defaults, a TOML file, dotted overrides, one clear error.

Precedence: defaults < ``--config FILE`` < named flags (``--steps``) < ``--set a.b=value``.

The run-wide options are fields here; each backend's section (``[torch]``, ``[sim]``, ``--cluster
ray``'s ``[ray]``, a third-party backend's ``[mybackend]``) is defined by the backend itself (its
``BackendPlugin.config``), and another room's (``headrace serve``'s ``[serve]``) by that room
(``registry.sections``); each is checked against its model: ``config.section(NAME)``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from headrace.core.errors import ConfigError, did_you_mean
from headrace.core.types import SamplingParams
from headrace.plugins import registry
from headrace.plugins.backends import get_plugin, section_model
from headrace.run.loss_config import LossConfig
from headrace.run.trackers import check_names

__all__ = ["RunConfig", "build_config", "set_override"]


MAX_SEED = 2**32 - 1
MAX_CONFIG_BYTES = 16 * 2**20  # a bigger --config is a wrong file (a checkpoint, a dataset)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SamplingConfig(_Section):
    max_tokens: int = Field(4, ge=1, description="most tokens per action")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature; 0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling: the smallest set of tokens this likely")
    top_k: int = Field(-1, description="-1 = no top-k")

    def params(self) -> SamplingParams:
        """The engine's sampling parameters for these options (the one place they are built from
        the config: the run's episodes, its backend's context, ``serve``'s defaults and gate)."""
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k
        )


class OptimConfig(_Section):
    learning_rate: float = Field(3e-4, gt=0.0, description="Adam's learning rate (--lr)")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="Adam's decay of the gradient's running mean")
    beta2: float = Field(0.95, ge=0.0, lt=1.0, description="Adam's decay of the squared gradient's running mean")
    eps: float = Field(1e-8, gt=0.0, description="Adam's epsilon, added to the denominator")
    weight_decay: float = Field(0.0, ge=0.0, description="decoupled weight decay (AdamW)")
    grad_clip_norm: float = Field(1.0, ge=0.0, description="0 = no clipping")


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


class ClusterConfig(_Section):
    """``--cluster NAME``: a plugin of kind ``cluster`` that places the backend's parts in processes
    of its own, configured by its own section (``[ray]``)."""

    kind: str = Field("none", description="none: one process; ray: actors on a Ray cluster (options: ray.*)")


class RunConfig(_Section):
    # a key that is no field is a backend's section, checked by _backend_sections (the rest refused)
    model_config = ConfigDict(extra="allow", validate_assignment=True)

    env: str = Field("arithmetic", description="env name (`headrace envs`), or FILE.py:NAME / package.module:NAME")
    env_options: dict[str, Any] = Field(default_factory=dict, description="passed to the env factory")
    scheduler: str = Field("sync", description="sync | stream | async | inflight (`headrace schedulers`)")
    backend: str = Field("torch", description="the training backend: sim | torch | tinker | ... (`headrace backends`)")
    sampler: str | None = Field(None, description="a sampler backend that samples for the training backend (e.g. vllm)")
    model: str = Field("tiny", description="'tiny' (embedded), a Hugging Face name, or a local directory")
    log_rollouts: int = Field(
        8, ge=0, description="trajectories per step written to RUN_DIR/rollouts/ for `headrace view` (0 = none)"
    )
    renderer: str | None = Field(
        None, description="chat_template | role_colon | tiny | plain_text; None = the model's default"
    )
    steps: int = Field(120, ge=1, description="optimizer steps")
    # 8 x 64: measured on the default run (benchmarks/RESULTS.md, "The default run"): with the whole
    # answer graded, 32 x 16 collapsed onto the commonest sum; fewer problems, more samples each learn
    batch_size: int = Field(8, ge=1, description="groups per step")
    group_size: int = Field(64, ge=1, description="samples per problem")
    num_minibatches: int = Field(4, ge=1, description="stream: forward_backward calls per step")
    max_steps_off_policy: int = Field(1, ge=0, description="async: how far sampling may run ahead")
    rollout_workers: int | None = Field(None, ge=1, description="concurrent groups; default: every admitted group")
    max_turns: int = Field(16, ge=1, description="most turns of one episode")
    # every backend seeds numpy, torch or vLLM with it, and numpy takes 0..2**32-1 only
    seed: int = Field(0, description="random seed, 0 to 2**32-1")
    run_dir: str | None = Field(None, description="where the run writes; None = runs/ENV-SCHEDULER-BACKEND-TIME")
    resume: bool = Field(False, description="continue the run in run_dir from its last checkpoint (--resume)")
    overwrite: bool = Field(False, description="replace the run in run_dir (only a directory that holds a run)")
    progress: bool = Field(True, description="the live display (--no-progress turns it off)")
    log: list[str] = Field(
        default_factory=list,
        description="trackers that also get each metrics row: wandb, tensorboard (a list or 'wandb,tensorboard'; "
        "pip install 'headrace[wandb]' / 'headrace[tensorboard]')",
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    advantages: AdvantageConfig = Field(default_factory=AdvantageConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)  # --cluster ray

    def section(self, name: str) -> Any:
        """Section ``[name]`` (a backend's, or a room's such as ``serve``), validated by its model:
        what the config sets, else the model's defaults."""
        if self.__pydantic_extra__ and name in self.__pydantic_extra__:
            return self.__pydantic_extra__[name]
        model = section_model(name)
        return model() if model is not None else get_plugin(name).config()  # unknown: the closest names

    @property
    def sections(self) -> dict[str, BaseModel]:
        """The sections this config holds: those it was given, and its backend's, sampler's and
        cluster's (their defaults where it set nothing), by name."""
        return dict(self.__pydantic_extra__ or {})

    @field_validator("log", mode="before")
    @classmethod
    def _tracker_names(cls, names: Any) -> Any:
        if isinstance(names, str):  # --log wandb,tensorboard
            names = [name.strip() for name in names.split(",") if name.strip()]
        return check_names(list(dict.fromkeys(names))) if isinstance(names, list) else names

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
        if isinstance(data, dict) and "pipeline" in data:  # a benchmark-only switch, gone (always pipelined)
            data = {k: v for k, v in data.items() if k != "pipeline"}
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _backend_sections(cls, data: Any, handler: Any) -> Any:
        """Keys that are no field are sections (a backend's, or a room's such as ``serve``), each
        validated by its model; the run's backend, sampler and cluster get theirs (defaults) even
        when unset, so config.json records what they ran with. Other sections given are checked
        and kept."""
        if not isinstance(data, dict):
            return handler(data)
        data = _legacy_cluster(data)
        known = {*cls.model_fields, "save_every", "pipeline"}  # the legacy keys go to _legacy_save_every
        given = {k: v for k, v in data.items() if k not in known}
        errors: list[InitErrorDetails] = []
        try:
            config = handler({k: v for k, v in data.items() if k in known})
        except ValidationError as e:
            if not given:
                raise
            config, errors = None, [_detail(item) for item in e.errors()]
        sections: dict[str, BaseModel] = {}
        for name, value in given.items():
            try:
                sections[name] = _section(name, value)
            except ValidationError as e:
                errors += [_detail(item, (name,)) for item in e.errors()]
            except _NoSuchSection:
                errors.append(InitErrorDetails(type="extra_forbidden", loc=(name,), input=value))
            except Exception as e:  # a plugin that fails to load (raised in its own module)
                message = f"cannot check this section: loading backend '{name}' failed: {type(e).__name__}: {e}"
                item = {"type": "backend_unavailable", "msg": message, "loc": (), "input": value}
                errors.append(_detail(item, (name,)))
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        assert config is not None
        for name in (config.backend, config.sampler, config.cluster.kind):
            plugin = _run_plugin(name)
            if plugin is not None and plugin.name not in sections:
                sections[plugin.name] = plugin.config()
        config.__pydantic_extra__ = sections
        return config


class _NoSuchSection(LookupError):
    pass


def _legacy_cluster(data: Any) -> Any:
    """A cluster's options were ``cluster.*`` beside ``cluster.kind``; they are its plugin's section
    now (``[ray]``). The older form (config files, ``--set cluster.rollout_workers=2``, the
    config.json of earlier runs) is moved there, under what that section sets itself; beside
    ``kind = "none"`` they configured nothing."""
    cluster = data.get("cluster") if isinstance(data, dict) else None
    if not isinstance(cluster, dict) or not set(cluster) - {"kind"}:
        return data
    kind = cluster.get("kind", "none")
    options = {k: v for k, v in cluster.items() if k != "kind"}
    data = {**data, "cluster": {"kind": kind}}
    if isinstance(kind, str) and kind != "none":
        given = data.get(kind)
        data[kind] = {**options, **given} if isinstance(given, dict) else (given or options)
    return data


def _section(name: str, value: Any) -> BaseModel:
    model = section_model(name)
    if model is None:
        raise _NoSuchSection(name)
    section: BaseModel = model.model_validate(value)
    return section


def _run_plugin(name: str | None) -> Any:
    """The run's backend, sampler or cluster plugin, for its default section; None where the name
    is unset, "none" or wrong (that is reported when the backend is made, with the closest names)."""
    if not name or name == "none":
        return None
    try:
        return get_plugin(name)
    except Exception:  # noqa: BLE001 - reported by make_backend / `headrace run`, with the fix
        return None


def _detail(item: Any, prefix: tuple[str, ...] = ()) -> InitErrorDetails:
    """An error of a section (or of the fields) as one of the whole config's, where it stands."""
    return InitErrorDetails(
        type=PydanticCustomError(item["type"], item["msg"]), loc=(*prefix, *item["loc"]), input=item.get("input")
    )


def set_override(tree: dict[str, Any], item: str, example: str = "sampling.temperature=0.7") -> None:
    """Set one ``key.sub=value`` item (``--set``, a bench scenario's override) in ``tree``; the
    value is a TOML literal where it parses as one, else a plain string."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' has no '='; write it as key=value, e.g. {example}")
    key, raw = item.split("=", 1)
    _set_dotted(tree, key.strip(), _parse_value(raw.strip()))


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
        set_override(tree, item)
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
            valid = _valid_names(item["loc"][:-1])
            prefix = "".join(f"{p}." for p in item["loc"][:-1])
            # nothing close (e.g. 'lr'): the section's options are a short list
            hint = did_you_mean(str(item["loc"][-1]), valid, prefix) or f" (valid here: {', '.join(sorted(valid))})"
            lines.append(f"unknown option '{where}'{hint}")
        else:
            msg = item["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg} (got {item.get('input')!r})")
    return "invalid configuration: " + "; ".join(lines) + ". See `headrace run --help` for every option."


def _valid_names(loc: tuple[Any, ...]) -> list[str]:
    """The options valid at ``loc``: a section's fields, or at the top the run's fields and the
    sections (every registered backend's name, and the rooms' sections)."""
    section: type[BaseModel] = RunConfig
    if loc:
        try:
            model = section_model(str(loc[0]))
        except Exception:  # noqa: BLE001 - a broken plugin: its fields cannot be listed
            model = None
        if model is not None:
            section, loc = model, loc[1:]
    for part in loc:
        field = section.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type):
            break
        section = field.annotation
    if section is RunConfig:
        return [*RunConfig.model_fields, *registry.backends.names(), *registry.sections.names()]
    return list(section.model_fields)
