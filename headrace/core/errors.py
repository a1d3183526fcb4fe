"""The error every layer may raise for input it refuses before a run starts (exported as
``headrace.ConfigError``): a wrong option, name, path or file. The CLI answers it with its
message and exit status 2."""

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A configuration the engine refuses; the message names the problem and the fix."""


class BackendFailure(RuntimeError):
    """A backend stopped the run for a reason its message explains (what failed and how to go on):
    the CLI shows the message as is, exit status 1. Raise a subclass from a backend of your own."""


def did_you_mean(name: str, choices: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or nothing: for a refusal's message."""
    match = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean '{prefix}{match[0]}'?)" if match else ""
