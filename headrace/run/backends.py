"""Backends as plugins: find one by name, check a run's pick, and build it from a ``RunConfig``.

A backend is a ``BackendPlugin`` (``headrace/core/protocols.py``) in ``registry.backends``: its
config section, flags and factory. ``make_backend(config)`` gives the factory its section
(``config.section(name)``) and a ``BackendContext``, never the whole config; with ``--sampler
NAME`` the sampler's factory also gets the training backend it samples for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from headrace.core.errors import ConfigError
from headrace.core.protocols import Backend, BackendContext, BackendPlugin
from headrace.core.types import SamplingParams
from headrace.run import registry

if TYPE_CHECKING:
    from headrace.run.config import RunConfig

__all__ = ["BackendContext", "BackendPlugin", "context", "get_plugin", "make_backend", "plugins", "section_plugin"]

KINDS = {"training": "--backend", "sampler": "--sampler"}


def get_plugin(name: str, kind: str | None = None) -> BackendPlugin:
    """The plugin ``name`` (a registered name, or ``module:NAME`` / ``file.py:NAME``), checked to
    be a ``BackendPlugin`` of ``kind``. Unknown names raise ``UnknownNameError`` (closest name)."""
    entry = registry.backends.get(name)
    if not isinstance(entry, BackendPlugin):
        raise ConfigError(
            f"backend '{name}' is a {type(entry).__name__}, not a headrace.core.protocols.BackendPlugin: a "
            "'headrace.backends' entry point (or a reference) must name the plugin object, which names the "
            "backend's config section, flags and factory"
        )
    if ":" not in name and entry.name != name:
        raise ConfigError(
            f"the 'headrace.backends' entry point '{name}' names a plugin called '{entry.name}': its config "
            f"section would be [{entry.name}]. Give the entry point and the plugin the same name."
        )
    if kind is not None and entry.kind != kind:
        others = ", ".join(n for n, p in plugins() if isinstance(p, BackendPlugin) and p.kind == kind)
        if entry.kind == "sampler":
            fix = f"it samples for a training backend: pass --backend TRAINING --sampler {entry.name}"
        else:
            fix = f"it trains and samples on its own: pass it as --backend {entry.name}, without --sampler"
        raise ConfigError(
            f"{KINDS[kind]} {name}: '{entry.name}' is a {entry.kind} backend, not a {kind} one; {fix}. "
            f"{kind.capitalize()} backends here: {others or 'none'}."
        )
    return entry


def plugins() -> list[tuple[str, BackendPlugin | Exception]]:
    """Every registered backend, by name; one that cannot load gives its error instead (a
    listing or ``--help`` shows it, and the rest still work)."""
    out: list[tuple[str, BackendPlugin | Exception]] = []
    for name in registry.backends.names():
        try:
            out.append((name, get_plugin(name)))
        except Exception as e:  # noqa: BLE001 - a broken third-party plugin must not break the others
            out.append((name, e))
    return out


def section_plugin(name: str) -> BackendPlugin | None:
    """The plugin whose config section is ``[name]``, None if no backend is called that."""
    if name not in registry.backends.names():
        return None
    return get_plugin(name)


def context(
    config: RunConfig, lag: int | None = None, resume_checkpoint: tuple[int, str] | None = None
) -> BackendContext:
    """The run-wide facts a backend may read. ``lag``: the scheduler's (asked of it when not given);
    ``resume_checkpoint``: the run directory's latest checkpoint, when resuming."""
    if lag is None:
        lag = registry.schedulers.get(config.scheduler)(config).lag()
    s = config.sampling
    return BackendContext(
        model=config.model,
        seed=config.seed,
        run_dir=config.run_dir,
        resume=config.resume,
        sampling=SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k),
        group_size=config.group_size,
        # as run/graph.py sizes the rollout actor: every batch the gate may admit, unless capped
        max_concurrent_rollouts=config.rollout_workers or max(config.batch_size * (lag + 1), 1),
        resume_checkpoint=resume_checkpoint,
    )


def check(config: RunConfig) -> tuple[BackendPlugin, BackendPlugin | None]:
    """The run's training backend and sampler, checked (names, kinds, installed modules) before
    anything is built: a wrong pick is one clear error, not a failure deep in set-up."""
    training = get_plugin(config.backend, "training")
    sampler = get_plugin(config.sampler, "sampler") if config.sampler else None
    for plugin in filter(None, (training, sampler)):
        if missing := plugin.missing():
            how = f" Install them: {plugin.install}." if plugin.install else ""
            raise ConfigError(f"the '{plugin.name}' backend needs {', '.join(missing)}, not installed here.{how}")
    return training, sampler


def build(
    plugin: BackendPlugin, config: RunConfig, training: Backend | None = None, ctx: BackendContext | None = None
) -> Any:
    """``plugin``'s backend for ``config``: its factory called with its section and the context
    (and, for a sampler, the training backend)."""
    ctx = ctx if ctx is not None else context(config)
    section = config.section(plugin.name)
    factory = plugin.load_factory()
    if plugin.kind == "sampler":
        if training is None:
            raise ConfigError(f"the '{plugin.name}' sampler samples for a training backend; none was given")
        return factory(section, ctx, training)
    return factory(section, ctx)


def make_backend(
    config: RunConfig, *, lag: int | None = None, resume_checkpoint: tuple[int, str] | None = None
) -> Backend:
    """The run's backend: ``--backend``'s, with its sampling on ``--sampler``'s if one is named."""
    training, sampler = check(config)
    if config.cluster.kind == "ray":
        from headrace.cluster.backend import make_cluster_backend

        if lag is None:
            lag = registry.schedulers.get(config.scheduler)(config).lag()
        return make_cluster_backend(config, lag)
    ctx = context(config, lag, resume_checkpoint)
    backend = build(training, config, ctx=ctx)
    if sampler is not None:
        backend = build(sampler, config, backend, ctx)
    return backend
