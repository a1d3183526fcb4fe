"""Name → factory registries for envs, schedulers and backends: the only global state.

Envs can also come from other packages through the ``headrace.envs`` entry-point group, so a
separate package adds envs without touching this repo::

    [project.entry-points."headrace.envs"]
    my_env = "my_package.envs:make_dataset"
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Generic, TypeVar

T = TypeVar("T")


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

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
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


def register_env(name: str) -> Callable[[T], T]:
    """Decorator: ``@register_env("my_env")`` on a ``(EnvContext) -> RLDataset`` factory."""
    return envs.register(name)  # type: ignore[return-value]
