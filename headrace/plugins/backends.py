"""Backends as plugins: find one by name, check it, and build it from its section and a context.

A backend is a ``BackendPlugin`` (``headrace/core/protocols.py``) in ``registry.backends``: its
config section, flags and factory. ``build`` gives the factory its section and a
``BackendContext``, never the whole run config; a sampler's factory also gets the training
backend it samples for, a cluster's the inner backends it places (``InnerBackend``: names and
sections, which it builds in its own processes with ``build_inner``). ``headrace/run/backends.py``
builds the run's from its ``RunConfig``.
"""

from __future__ import annotations

from typing import Any

from headrace.core.errors import ConfigError
from headrace.core.protocols import BackendContext, BackendPlugin, InnerBackend
from headrace.plugins import registry

__all__ = ["build", "build_inner", "checked", "get_plugin", "plugins", "section_model", "section_plugin"]

KINDS = {"training": "--backend", "sampler": "--sampler", "cluster": "--cluster"}
FIXES = {
    "training": "it trains and samples on its own: pass it as --backend {name}, without --sampler",
    "sampler": "it samples for a training backend: pass --backend TRAINING --sampler {name}",
    "cluster": "it places a training backend's parts in processes of its own: pass --cluster {name}",
}


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
        fix = FIXES.get(entry.kind, "").format(name=entry.name)
        raise ConfigError(
            f"{KINDS[kind]} {name}: '{entry.name}' is a {entry.kind} backend, not a {kind} one; {fix}. "
            f"{kind.capitalize()} backends here: {others or 'none'}."
        )
    return entry


def checked(name: str, kind: str) -> BackendPlugin:
    """``get_plugin(name, kind)``, with the modules it needs installed: a wrong pick is one clear
    error before anything is built, not a failure deep in set-up."""
    plugin = get_plugin(name, kind)
    if missing := plugin.missing():
        how = f" Install them: {plugin.install}." if plugin.install else ""
        raise ConfigError(f"the '{plugin.name}' backend needs {', '.join(missing)}, not installed here.{how}")
    return plugin


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


def section_model(name: str) -> Any:
    """The pydantic model of the config section ``[name]``: a backend's (its plugin's), or one a
    room registered (``registry.sections``: ``[serve]``); None if nothing is called that."""
    plugin = section_plugin(name)
    if plugin is not None:
        return plugin.config
    return registry.sections.get(name) if name in registry.sections.names() else None


def build(plugin: BackendPlugin, section: Any, ctx: BackendContext, *given: Any) -> Any:
    """``plugin``'s backend: its factory called with its section and the context, and what its
    kind is given (a sampler: the training backend; a cluster: the training and sampler
    ``InnerBackend``)."""
    if plugin.kind == "sampler" and not given:
        raise ConfigError(f"the '{plugin.name}' sampler samples for a training backend; none was given")
    return plugin.load_factory()(section, ctx, *given)


def build_inner(inner: InnerBackend, ctx: BackendContext, *given: Any) -> Any:
    """The backend ``inner`` names, built here (in a process of a cluster's own): its section
    checked again by its plugin."""
    plugin = get_plugin(inner.name)
    return build(plugin, plugin.config.model_validate(inner.section), ctx, *given)
