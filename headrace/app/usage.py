"""argparse's own errors (a mistyped command or flag, a value of the wrong type) in the style of
every other headrace error: one paragraph naming the problem, the closest valid name and the fix,
exit status 2, instead of argparse's usage dump."""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from headrace.core.errors import ConfigError

TYPE_NAMES = {"int": ("a whole number", "3"), "float": ("a number", "0.5")}


class CommandLineError(ConfigError):
    """A command line argparse refused; the message is the paragraph to show."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise ``CommandLineError`` with one clear paragraph.
    Subparsers made from it are Parsers too (argparse uses the parent's class)."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        self._argv = list(args or [])  # to tell which command an unrecognized flag was meant for
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        raise CommandLineError(explain(self, message))


def closest(name: str, valid: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the nearest valid name, or nothing."""
    match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""


def explain(parser: Parser, message: str) -> str:
    commands = _commands(parser)
    if m := re.match(r"argument (\S+): invalid choice: '?([^' ]*)'?", message):
        target, value = m.groups()
        if target == "COMMAND" and commands:
            return f"unknown command '{value}'.{closest(value, commands)} Commands: {', '.join(commands)}."
        action = _action(parser, target)
        choices = [str(c) for c in (action.choices or ())] if action else []
        return f"{target} does not take '{value}'.{closest(value, choices)} Valid: {', '.join(choices)}."
    if m := re.match(r"argument (\S+): invalid (\w+) value: '(.*)'", message):
        flag, kind, value = m.groups()
        what, example = TYPE_NAMES.get(kind, (f"a {kind} value", "VALUE"))
        return f"{flag} takes {what}, not '{value}' (e.g. `{flag} {example}`)."
    if m := re.match(r"argument (\S+): expected (.*)", message):
        flag, wanted = m.groups()
        return f"{flag} needs a value ({wanted}): write `{flag} VALUE`; `{parser.prog} --help` says what it takes."
    if m := re.match(r"the following arguments are required: (.*)", message):
        if m.group(1) == "COMMAND" and commands:
            return (
                f"{parser.prog} needs a command: one of {', '.join(commands)} "
                f"(`{parser.prog} --help` says what each does)."
            )
        return f"`{parser.prog}` needs {m.group(1)}; `{parser.prog} --help` says what it is."
    if m := re.match(r"unrecognized arguments: (.*)", message):
        return _unrecognized(parser, m.group(1).split())
    if m := re.match(r"ambiguous option: (\S+) could match (.*)", message):
        return f"'{m.group(1)}' is ambiguous: it could be {m.group(2)}. Write the option out in full."
    return f"{message}. See `{parser.prog} --help`."


def _unrecognized(parser: Parser, extras: list[str]) -> str:
    """An unknown flag, told against the options of the command it was given to."""
    argv = getattr(parser, "_argv", [])
    sub = _subparsers(parser)
    command = next((a for a in argv if sub and a in sub.choices), None)
    target = sub.choices[command] if sub and command else parser
    options = sorted({o for a in target._actions for o in a.option_strings if o.startswith("--")})
    word = next((e for e in extras if e.startswith("-")), extras[0])
    where = f"`{target.prog}`"
    if not word.startswith("-"):
        hint = f" Did you mean `--set {word}`?" if "=" in word else ""
        return f"{where} does not take '{word}' here.{hint} `{target.prog} --help` lists what it takes."
    flag = word.split("=", 1)[0]
    return f"unknown option '{flag}' for {where}.{closest(flag, options)} `{target.prog} --help` lists every option."


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    sub = _subparsers(parser)
    return list(sub.choices) if sub else []


def _action(parser: argparse.ArgumentParser, name: str) -> argparse.Action | None:
    return next((a for a in parser._actions if name in a.option_strings or name in (a.dest, a.metavar)), None)
