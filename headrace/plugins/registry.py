"""Name → factory registries for envs, schedulers, backends and config sections: the only global state.

Envs (and backends, through ``headrace.backends``: see ``headrace/core/protocols.py``) can also come
from other packages through the ``headrace.envs`` entry-point group, so a separate package adds envs
without touching this repo::

    [project.entry-points."headrace.envs"]
    my_env = "my_package.envs:make_dataset"

or, unpackaged, by reference: ``path/to/file.py:NAME`` or ``package.module:NAME`` names the
attribute NAME of that file or importable module (``headrace run --env my_env.py:make_dataset``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import importlib
import importlib.util
import re
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Generic, TypeVar

from headrace.core.errors import ConfigError, HeadraceError
from headrace.plugins.env_options import DeclaredOptions

T = TypeVar("T")
_MISSING = object()


class UnknownNameError(HeadraceError, LookupError):
    """A name that no registry entry has; the message lists the valid ones and the closest."""


class Registry(Generic[T]):
    def __init__(self, kind: str, entry_point_group: str | None = None, builtins: dict[str, str] | None = None):
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._entry_point_group = entry_point_group
        self._entry_points_loaded = entry_point_group is None
        # name -> "module:attr", imported on first use so optional extras stay optional
        self._lazy: dict[str, str] = dict(builtins or {})

    def register(self, name: str, value: T | None = None) -> Callable[[T], T] | T:
        """``registry.register("name", obj)`` or ``@registry.register("name")``."""
        if value is not None:
            self._entries[name] = value
            return value

        def decorate(obj: T) -> T:
            self._entries[name] = obj
            return obj

        return decorate

    @contextmanager
    def temporarily(self, name: str, value: T) -> Iterator[T]:
        """Register ``name`` for the block only (tests, notebooks: nothing leaks into the rest of
        the process); what it named before, if anything, comes back after."""
        with self.scoped(name):
            self.register(name, value)
            yield value

    @contextmanager
    def scoped(self, *names: str) -> Iterator[Registry[T]]:
        """After the block, ``names`` name what they named before it: whatever registers them
        inside (``register``, the decorator, an entry point found there) is undone."""
        before = {name: (self._entries.get(name, _MISSING), self._lazy.get(name, _MISSING)) for name in names}
        try:
            yield self
        finally:
            for name, (entry, lazy) in before.items():
                _put_back(self._entries, name, entry)
                _put_back(self._lazy, name, lazy)

    def rescan(self) -> None:
        """Read the entry points again on next use: for a package put on the path since."""
        self._entry_points_loaded = self._entry_point_group is None

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted({*self._entries, *self._lazy})

    def get(self, name: str) -> T:
        if ":" in name:  # a file or module is imported once (sys.modules), then looked up again
            return load_reference(name, self.kind)
        self._load_entry_points()
        if name not in self._entries and name in self._lazy:
            module, _, attr = self._lazy[name].partition(":")
            loaded = importlib.import_module(module)
            if attr and name not in self._entries:
                self._entries[name] = getattr(loaded, attr)
        if name not in self._entries:
            valid = self.names()
            match = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
            hint = f" Did you mean '{match[0]}'?" if match else ""
            elsewhere = (
                f" One defined elsewhere is named by reference, 'path/to/file.py:NAME' or 'package.module:NAME', "
                f"or published by a package through the '{self._entry_point_group}' entry-point group."
                if self._entry_point_group
                else ""
            )
            raise UnknownNameError(
                f"unknown {self.kind} '{name}'. Valid {self.kind}s: {', '.join(valid)}.{hint}{elsewhere}"
            )
        return self._entries[name]

    def describe(self, name: str) -> str:
        """One line for a listing: the first line of the entry's docstring, else of its module's.
        Loads a lazy entry; one that cannot load says why instead of breaking the listing."""
        try:
            entry = self.get(name)
        except Exception as e:  # noqa: BLE001 - an optional extra missing, a broken plugin
            return f"(cannot load: {type(e).__name__}: {e})".splitlines()[0]
        module = sys.modules.get(getattr(entry, "__module__", ""))
        doc = getattr(entry, "__doc__", None) or getattr(module, "__doc__", None) or ""
        return doc.strip().split("\n", 1)[0]

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        if self._entry_point_group is None:
            return
        for ep in entry_points(group=self._entry_point_group):
            if ep.name not in self._entries:
                self._lazy.setdefault(ep.name, ep.value)


envs: Registry[Callable] = Registry(
    "env",
    entry_point_group="headrace.envs",
    builtins={
        "arithmetic": "headrace.envs.arithmetic:make_dataset",
        "guess_number": "headrace.envs.guess_number:make_dataset",
        "faulty": "headrace.envs.faulty:make_dataset",
        "flaky_arithmetic": "headrace.envs.faulty:make_flaky_arithmetic",
        # the task library (headrace.tasks): graders, datasets, tools, games, judges
        "word_math": "headrace.tasks.math_envs:make_word_math",
        "gsm8k": "headrace.tasks.math_envs:make_gsm8k",
        "math": "headrace.tasks.math_envs:make_math",
        "tool_calc": "headrace.tasks.tool_calc:make_dataset",
        "code": "headrace.tasks.code_env:make_code",
        "code_multi_turn": "headrace.tasks.code_env:make_code_multi_turn",
        "harbor": "headrace.tasks.harbor:make_dataset",
        "tictactoe": "headrace.tasks.tictactoe:make_dataset",
        "pairwise_judge": "headrace.tasks.pairwise_judge:make_dataset",
        # environments from the ecosystem (headrace.ecosystem), their packages imported when used
        "openenv": "headrace.ecosystem.openenv_env:make_dataset",
        "verifiers": "headrace.ecosystem.verifiers_env:make_dataset",
    },
)
schedulers: Registry[Callable] = Registry(
    "scheduler",
    builtins={
        "sync": "headrace.schedulers.sync:SyncScheduler",
        "stream": "headrace.schedulers.stream:StreamScheduler",
        "async": "headrace.schedulers.async_:AsyncScheduler",
        "inflight": "headrace.schedulers.inflight:InflightScheduler",
    },
)


def _builtin_backends() -> dict[str, str]:
    """headrace's own backend plugins, found in the source tree (``headrace/backends/NAME/plugin.py``
    or ``headrace/backends/NAME.py``'s ``plugin``), so a tree that was never installed (no entry
    points) still has them. Nothing is imported here."""
    root = Path(__file__).resolve().parent.parent / "backends"
    found = {}
    for child in sorted(root.iterdir()):
        if (child / "plugin.py").is_file():
            found[child.name] = f"headrace.backends.{child.name}.plugin:plugin"
        elif child.suffix == ".py" and child.stem != "__init__" and "plugin =" in child.read_text():
            found[child.stem] = f"headrace.backends.{child.stem}:plugin"
    return found


# BackendPlugin entries (headrace.core.protocols): training backends, samplers and clusters alike,
# each with its config section, flags and factory (headrace.plugins.backends builds them); packages
# add theirs through the entry-point group. Listing, --help and config checks import only the
# plugin modules, never torch, vLLM, Ray or an SDK.
backends: Registry[Any] = Registry("backend", entry_point_group="headrace.backends", builtins=_builtin_backends())
# config sections of rooms that are no backend, by the section's name: each a pydantic model,
# defined (and so registered) by the room it configures, so the run config names no room above it
sections: Registry[Any] = Registry(
    "config section",
    builtins={
        "serve": "headrace.serve.config:ServeConfig",
        "sft": "headrace.posttrain.config:SFTConfig",
        "dpo": "headrace.posttrain.config:DPOConfig",
        "sdft": "headrace.posttrain.config:SDFTConfig",
    },
)


def load_reference(reference: str, kind: str = "entry") -> Any:
    """What ``path/to/file.py:NAME`` or ``package.module:NAME`` names. A file is loaded as a module
    of its own (registered in ``sys.modules``, so its dataclasses and pickling work), without
    being packaged or put on ``sys.path``."""
    source, _, attr = reference.rpartition(":")
    forms = "'path/to/file.py:NAME' (a Python file) or 'package.module:NAME' (an importable module)"
    if not source or not attr.isidentifier():
        raise UnknownNameError(f"cannot read {kind} '{reference}': a reference is {forms}, NAME an attribute of it")
    if _is_file(source):
        module = _load_file(Path(source).expanduser(), reference, kind)
    else:
        try:
            module = importlib.import_module(source)
        except ModuleNotFoundError as e:
            if e.name is None or not (source == e.name or source.startswith(f"{e.name}.")):
                raise _import_failed(e, reference, kind, source) from e  # found, but what it imports is not
            raise UnknownNameError(
                f"cannot load {kind} '{reference}': no module named '{e.name}' on the Python path (sys.path). "
                f"Install its package, run from the directory that holds it, or name a file instead: {forms}"
            ) from None
        except Exception as e:
            raise _import_failed(e, reference, kind, source) from e
    try:
        return getattr(module, attr)
    except AttributeError:
        found = sorted(
            n
            for n, v in vars(module).items()
            if not n.startswith("_") and callable(v) and getattr(v, "__module__", None) == module.__name__
        )
        match = difflib.get_close_matches(attr, found, n=1, cutoff=0.5)
        hint = f" Did you mean '{match[0]}'?" if match else ""
        raise UnknownNameError(
            f"cannot load {kind} '{reference}': {module.__name__} ({getattr(module, '__file__', '?')}) has no "
            f"attribute '{attr}'. It defines: {', '.join(found) or 'no function'}.{hint}"
        ) from None


def reference_label(name: str) -> str:
    """``name`` fit for a file name: ``dir/my_env.py:make_dataset`` -> ``my_env-make_dataset``."""
    source, colon, attr = name.rpartition(":")
    if colon:
        stem = Path(source).stem if _is_file(source) else source.rpartition(".")[2]
        name = f"{stem}-{attr}"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "env"


FILE_MODULE_PREFIX = "headrace_file_"  # a module loaded from a file (--env path.py:factory): no import finds it


def file_modules() -> list[Any]:
    """The modules loaded from files so far: another process cannot import them by name, so what
    is sent there from them (a Ray rollout worker's group builder) is sent by value."""
    return [m for name, m in list(sys.modules.items()) if name.startswith(FILE_MODULE_PREFIX)]


def _is_file(source: str) -> bool:
    return source.endswith(".py") or "/" in source or "\\" in source or source.startswith("~")


def _load_file(path: Path, reference: str, kind: str) -> Any:
    if not path.is_file():
        where = "is a directory" if path.is_dir() else "does not exist"
        raise UnknownNameError(
            f"cannot load {kind} '{reference}': the file {path} {where} (resolved from {Path.cwd()}). "
            "Give the path of a Python file, relative to the current directory or absolute."
        )
    path = path.resolve()
    # one module per file, under a name no real module has
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    name = f"{FILE_MODULE_PREFIX}{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UnknownNameError(f"cannot load {kind} '{reference}': {path} is not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]  # a fixed file loads afresh next time
        if isinstance(e, Exception):
            raise _import_failed(e, reference, kind, str(path)) from e
        raise
    return module


def _import_failed(error: Exception, reference: str, kind: str, source: str) -> ConfigError:
    """The user's file or module raised while it was imported: where, and what."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != __file__]
    frames = [f for f in frames if "importlib" not in f.filename]  # the user's frames only
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return ConfigError(
        f"cannot load {kind} '{reference}': importing {source} raised {type(error).__name__}{where}: {error}. "
        "Fix it and run again (--debug shows the traceback)."
    )


def _put_back(table: dict[str, Any], name: str, value: object) -> None:
    if value is _MISSING:
        table.pop(name, None)
    else:
        table[name] = value


def register_env(name: str, options: Mapping[str, Any] | None = None, passes_on: str | None = None) -> Callable[[T], T]:
    """Decorator: ``@register_env("my_env")`` on a ``(EnvContext) -> RLDataset`` factory.

    ``options``: the env's options with their defaults (every built-in env declares its own). The
    factory then gets ``ctx.options`` with each filled in and of its default's type, and a name it
    does not declare is refused with the closest one, before the run writes anything. Without it
    the factory gets the options as given. ``passes_on``: see ``DeclaredOptions``."""

    def decorate(factory: T) -> T:
        if options is None:
            return envs.register(name, factory)  # type: ignore[arg-type, return-value]
        declared = DeclaredOptions(name, dict(options), passes_on)

        @functools.wraps(factory)  # type: ignore[arg-type]
        def with_options(ctx: Any) -> Any:
            return factory(dataclasses.replace(ctx, options=declared.read(ctx.options, declared_options)))  # type: ignore[operator]

        with_options.options = declared  # type: ignore[attr-defined]
        return envs.register(name, with_options)  # type: ignore[return-value]

    return decorate


def declared_options(env: str) -> DeclaredOptions | None:
    """What the env ``env`` declares it takes; None for one that declares nothing (it takes any)."""
    declared = getattr(envs.get(env), "options", None)
    return declared if isinstance(declared, DeclaredOptions) else None


def check_env_options(env: str, given: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` (``UnknownEnvOption`` for a misspelt name) when ``given`` does not fit
    what ``env`` declares: for a run to refuse its options before it starts."""
    declared = declared_options(env)
    if declared is not None:
        declared.read(given, declared_options)
