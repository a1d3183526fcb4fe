"""An env's options (``env_options``), as it declares them: ``@register_env(name, options={...})``
names each option with its default. What a run gives is read against that: defaults filled in,
values coerced to the default's type, and a misspelt name refused with the closest valid one
(instead of silently ignored), before the run writes anything (``registry.check_env_options``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from headrace.core.errors import EnvError, did_you_mean

SPLITS = ("train", "test")


class UnknownEnvOption(EnvError, ValueError):
    """A name the env does not declare; the message names the closest and every valid one."""

    def __init__(self, env: str, name: str, known: list[str], wrapped: UnknownEnvOption | None = None):
        self.env, self.name, self.known = env, name, known
        listed = ", ".join(known)
        if wrapped is not None:  # the wrapping env's options, and those it passes on
            known = [*known, *wrapped.known]
            listed = f"{listed}, and {wrapped.env}'s {', '.join(wrapped.known)}"
            env = f"{env} env (wrapping {wrapped.env})"
        else:
            env = f"{env} env"
        super().__init__(f"the {env} has no option '{name}'{did_you_mean(name, known)}; its options are {listed}")


@dataclass(frozen=True)
class DeclaredOptions:
    """What an env takes. ``passes_on``: an option naming another env, which takes every option
    this one does not declare (``faulty`` wraps the env its ``env`` option names)."""

    env: str
    defaults: Mapping[str, Any]
    passes_on: str | None = None

    def read(self, given: Mapping[str, Any], declared_by: Callable[[str], DeclaredOptions | None]) -> dict[str, Any]:
        """``given`` read against the defaults; ``declared_by(env)`` gives the wrapped env's
        declaration, which checks (but does not fill) the options passed on to it."""
        if self.passes_on is None:
            return read_options(self.env, given, self.defaults)
        own = read_options(self.env, {k: v for k, v in given.items() if k in self.defaults}, self.defaults)
        rest = {k: v for k, v in given.items() if k not in self.defaults}
        inner = declared_by(str(own[self.passes_on]))
        if inner is not None:
            try:
                inner.read(rest, declared_by)
            except UnknownEnvOption as e:
                raise UnknownEnvOption(self.env, e.name, list(self.defaults), wrapped=e) from None
        return own | rest


def read_options(env: str, given: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` updated with ``given``; a default of None accepts any value. Raises
    ``ValueError`` (the engine turns it into a usage error, exit 2) for an unknown name or a
    value of the wrong type."""
    options = dict(defaults)
    for name, value in given.items():
        if name not in defaults:
            raise UnknownEnvOption(env, name, list(defaults))
        default = defaults[name]
        if default is None or value is None or isinstance(value, type(default)):
            options[name] = value
            continue
        try:
            if isinstance(default, bool):
                if str(value).lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                options[name] = str(value).lower() in ("true", "1")
            else:
                options[name] = type(default)(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"the {env} env's option {name}={value!r} should be a {type(default).__name__} (default {default!r})"
            ) from None
    if "split" in options and options["split"] not in SPLITS:
        raise ValueError(f"the {env} env's split must be one of {', '.join(SPLITS)} (got {options['split']!r})")
    return options
