"""Scenarios: a RunConfig fragment plus a ``[bench]`` table, in one small TOML file.

Every key outside ``[bench]`` is a ``headrace run`` option (the same keys as ``--config``; see
``headrace run --help``), so a scenario is a run config the harness runs once per scheduler. The
``[bench]`` table holds what only the harness reads::

    [bench]
    description = "sampling time ≈ training time"
    schedulers = ["sync", "stream", "async"]   # the default set when --schedulers is not given
    overhead = false                           # true: also measure the bare-asyncio floor
    notes = "..."                              # markdown for RESULTS.md: what the figures show

A scenario is named by a built-in name (``headrace bench --list``) or a path to a TOML file.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from headrace.core.errors import ConfigError
from headrace.plugins import registry
from headrace.run.config import RunConfig, load_toml, set_override, validate

SCHEDULERS = ("sync", "stream", "async")
_BENCH_KEYS = {"description": str, "schedulers": list, "overhead": bool, "notes": str}
# the order of `headrace bench --all` and RESULTS.md; other built-ins follow alphabetically
ORDER = (
    "balanced",
    "sampling_bound",
    "training_bound",
    "long_tail",
    "long_tail_heavy",
    "multi_turn",
    "agent_tools",
    "remote_api",
    "flaky",
    "overhead",
    "real_model",
)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    tree: dict[str, Any]  # the RunConfig fragment
    schedulers: tuple[str, ...] = SCHEDULERS
    overhead: bool = False
    notes: str = ""
    source: str = ""

    def config(self, scheduler: str, run_dir: str, overrides: dict[str, Any] | None = None) -> RunConfig:
        """The run config of this scenario for one scheduler."""
        tree = _merge(self.tree, overrides or {})
        tree |= {"scheduler": scheduler, "run_dir": run_dir, "overwrite": True, "resume": False, "progress": False}
        try:
            return validate(tree)
        except ConfigError as e:
            raise ConfigError(f"scenario '{self.name}' ({self.source}): {e}") from None


def builtin_names() -> list[str]:
    folder = resources.files("headrace.bench") / "scenarios"
    names = {p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml")}
    return [n for n in ORDER if n in names] + sorted(names - set(ORDER))


def builtin_path(name: str) -> Path:
    return Path(str(resources.files("headrace.bench") / "scenarios" / f"{name}.toml"))


def load_scenario(name_or_file: str) -> Scenario:
    """A built-in scenario by name, or a TOML file; any problem is one ``ConfigError`` paragraph."""
    names = builtin_names()
    if name_or_file in names:
        path, name = builtin_path(name_or_file), name_or_file
    else:
        path = Path(name_or_file)
        if not path.is_file():
            match = difflib.get_close_matches(name_or_file, names, n=1)
            hint = f" Did you mean '{match[0]}'?" if match else ""
            raise ConfigError(
                f"no scenario '{name_or_file}': it is neither a built-in scenario ({', '.join(names)}) "
                f"nor a TOML file.{hint}"
            )
        name = path.stem
    try:
        tree = load_toml(path)
    except ConfigError as e:
        raise ConfigError(f"scenario '{name}': {e}") from None
    bench = tree.pop("bench", {})
    if not isinstance(bench, dict):
        raise ConfigError(f"scenario '{name}' ({path}): 'bench' must be a table ([bench]), got {bench!r}")
    for key, value in bench.items():
        if key not in _BENCH_KEYS:
            match = difflib.get_close_matches(key, list(_BENCH_KEYS), n=1)
            hint = f" (did you mean '{match[0]}'?)" if match else ""
            raise ConfigError(
                f"scenario '{name}' ({path}): unknown [bench] key '{key}'{hint}; "
                f"[bench] takes {', '.join(_BENCH_KEYS)}, and every other key is a run option"
            )
        if not isinstance(value, _BENCH_KEYS[key]):
            raise ConfigError(
                f"scenario '{name}' ({path}): [bench] {key} must be a {_BENCH_KEYS[key].__name__}, got {value!r}"
            )
    schedulers = tuple(bench.get("schedulers", SCHEDULERS))
    scenario = Scenario(
        name=name,
        description=str(bench.get("description", "")),
        tree=tree,
        schedulers=schedulers,
        overhead=bool(bench.get("overhead", False)),
        notes=str(bench.get("notes", "")).strip(),
        source=str(path),
    )
    for scheduler in schedulers:  # every problem now, before anything runs
        check_scheduler(scheduler)
        scenario.config(scheduler, "unused")
    return scenario


def check_scheduler(name: str) -> None:
    try:
        registry.schedulers.get(name)
    except registry.UnknownNameError as e:
        raise ConfigError(str(e)) from None


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``key.sub=value`` items (as ``headrace run --set``) into a nested dict."""
    tree: dict[str, Any] = {}
    for item in items:
        set_override(tree, item, example="steps=10")
    return tree


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
