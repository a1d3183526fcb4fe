"""Name → factory registries for envs, schedulers and backends: the only global state.

Envs can also come from other packages through the ``headrace.envs`` entry-point group, so a
separate package adds envs without touching this repo::

    [project.entry-points."headrace.envs"]
    my_env = "my_package.envs:make_dataset"
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

T = TypeVar("T")
_MISSING = object()


class UnknownNameError(LookupError):
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
            raise UnknownNameError(f"unknown {self.kind} '{name}'. Valid {self.kind}s: {', '.join(valid)}.{hint}")
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
        "tictactoe": "headrace.tasks.tictactoe:make_dataset",
        "pairwise_judge": "headrace.tasks.pairwise_judge:make_dataset",
    },
)
schedulers: Registry[Callable] = Registry(
    "scheduler",
    builtins={
        "sync": "headrace.schedulers.sync:SyncScheduler",
        "stream": "headrace.schedulers.stream:StreamScheduler",
        "async": "headrace.schedulers.async_:AsyncScheduler",
    },
)
backends: Registry[Callable] = Registry(
    "backend",
    builtins={
        "sim": "headrace.backends.sim:make_backend",
        "torch": "headrace.backends.torch:make_backend",
        "tinker": "headrace.backends.tinker:make_backend",
    },
)
samplers: Registry[Callable] = Registry(
    "sampler",
    builtins={"vllm": "headrace.backends.vllm:make_sampler"},
)


def _put_back(table: dict[str, Any], name: str, value: object) -> None:
    if value is _MISSING:
        table.pop(name, None)
    else:
        table[name] = value


def register_env(name: str) -> Callable[[T], T]:
    """Decorator: ``@register_env("my_env")`` on a ``(EnvContext) -> RLDataset`` factory."""
    return envs.register(name)  # type: ignore[return-value]
