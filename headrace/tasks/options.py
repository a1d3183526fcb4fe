"""Reading a task's ``env_options``: defaults filled in, values coerced to the default's type,
and a misspelt name refused with the closest valid one (instead of silently ignored)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

SPLITS = ("train", "test")


def read_options(env: str, given: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` updated with ``given``; a default of None accepts any value. Raises
    ``ValueError`` (the engine turns it into a usage error, exit 2) for an unknown name or a
    value of the wrong type."""
    options = dict(defaults)
    for name, value in given.items():
        if name not in defaults:
            match = difflib.get_close_matches(name, list(defaults), n=1)
            hint = f" (did you mean '{match[0]}'?)" if match else ""
            raise ValueError(f"the {env} env has no option '{name}'{hint}; its options are {', '.join(defaults)}")
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
