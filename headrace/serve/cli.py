"""``headrace serve`` and ``headrace rollback``: argument parsing; the work is in ``run.py``."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from headrace.core.errors import ConfigError
from headrace.run.backends import check as check_backends
from headrace.run.config import RunConfig, build_config
from headrace.run.rundir import RunDir
from headrace.run.rundir_errors import RunDirError
from headrace.run.runlock import LOCK, RunLock

from .config import ServeConfig

# flag, config key, type, help: the options a served model shares with `headrace run`
FLAGS: list[tuple[str, str, type, str]] = [
    ("--backend", "backend", str, "the training backend: torch | tinker"),
    ("--sampler", "sampler", str, "a sampler backend that samples for it, e.g. vllm"),
    ("--model", "model", str, "'tiny' (embedded), a Hugging Face name, or a local directory"),
    ("--renderer", "renderer", str, "messages <-> tokens (default: the model's)"),
    ("--run-dir", "run_dir", str, "where versions.jsonl, completions, feedback and checkpoints go"),
    ("--seed", "seed", int, "random seed"),
    ("--host", "serve.host", str, "bind address (default 127.0.0.1)"),
    ("--port", "serve.port", int, "port (default 8000; 0 = a free one)"),
    ("--token-env", "serve.token_env", str, "the environment variable holding the bearer token"),
    ("--batch-size", "serve.batch_size", int, "scored completions per candidate"),
    ("--lr", "optim.learning_rate", float, "learning rate"),
    ("--loss", "loss.name", str, "the loss (as for headrace run)"),
    ("--max-tokens", "sampling.max_tokens", int, "default max_tokens of a request"),
    ("--temperature", "sampling.temperature", float, "default temperature of a request"),
]


def setup(parser: argparse.ArgumentParser) -> None:
    from headrace.app.cli import backend_flags, options_help

    parser.description = (
        "Serve a model through an OpenAI-compatible endpoint (POST /v1/chat/completions, GET /v1/models) and "
        "Anthropic's Messages API (POST /v1/messages), "
        "capture every completion, take rewards at POST /v1/feedback, and train candidate versions that are "
        "published or rolled back. Options as for `headrace run`, plus serve.* (--set serve.key=value)."
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "serve.* (--set serve.key=value, or a [serve] table in the TOML file):\n" + "\n".join(
        options_help(ServeConfig, "serve.")
    )
    parser.add_argument("--config", help="TOML file with any option (a [serve] table for serve.*)")
    rows: list[tuple[str, str, Any, str]] = [*FLAGS, *backend_flags()]
    for flag, dest, typ, text in rows:
        parser.add_argument(flag, dest=dest, type=typ, default=None, metavar=dest.rpartition(".")[2].upper(), help=text)
    parser.add_argument("--no-auth", dest="serve.no_auth", action="store_const", const=True, default=None,
                        help="serve without a token (loopback only)")  # fmt: skip
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--resume", action="store_const", const=True, default=None,
                        help="serve the incumbent of --run-dir's version chain again")  # fmt: skip
    parser.add_argument("--overwrite", action="store_const", const=True, default=None,
                        help="replace what --run-dir holds")  # fmt: skip
    parser.set_defaults(func=cmd_serve)


def serve_config(args: argparse.Namespace) -> RunConfig:
    from headrace.app.cli import backend_flags

    flags: dict[str, Any] = {dest: getattr(args, dest, None) for _, dest, _, _ in [*FLAGS, *backend_flags()]}
    flags |= {"serve.no_auth": getattr(args, "serve.no_auth"), "resume": args.resume, "overwrite": args.overwrite}
    flags |= {"progress": False, "env": "serve"}
    if not flags["run_dir"]:
        raise ConfigError("headrace serve needs --run-dir D: the version chain, completions and checkpoints live there")
    saved = RunDir.saved_options(Path(args.run_dir)) if args.resume else None
    # config.json records the [serve] section also where nothing in it was set
    return build_config(args.config, flags, args.overrides, base={"serve": {}, **(saved or {})})


def cmd_serve(args: argparse.Namespace) -> int:
    from .run import api_token, serve

    config = serve_config(args)
    token = api_token(config)
    check_backends(config)
    asyncio.run(serve(config, token, ready=lambda line: print(line, flush=True)))
    return 0


def setup_rollback(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Re-publish an earlier version of a served model, with the server stopped: the next "
        "`headrace serve --resume --run-dir D` serves it. (While it runs: POST /v1/admin/rollback.)"
    )
    parser.add_argument("run_dir", metavar="D", help="the service's run directory")
    parser.add_argument("--to", dest="version", type=int, required=True, metavar="V", help="the version to serve")
    parser.add_argument("--scenario", default=None, metavar="S",
                        help="with serve.per_scenario: the scenario whose chain rolls back")  # fmt: skip
    parser.set_defaults(func=cmd_rollback)


def cmd_rollback(args: argparse.Namespace) -> int:
    from .chain import FILENAME, SCENARIO_NAME, VersionChain

    path = Path(args.run_dir)
    if args.scenario is not None and not SCENARIO_NAME.fullmatch(args.scenario):
        raise ConfigError(
            f"--scenario {args.scenario!r} is not a scenario's name (1 to 64 letters, digits, '_' or '-')"
        )
    if not (path / FILENAME).is_file():
        raise ConfigError(f"'{path}' holds no version chain ({FILENAME}): it is not a `headrace serve` run directory")
    lock = RunLock(path / LOCK)
    try:
        lock.acquire()
    except RunDirError:
        holder = _holder(path / LOCK)
        if holder is None:
            raise
        # a server holds the directory: it rolls back by request, without stopping
        scenario = f', "scenario": "{args.scenario}"' if args.scenario else ""
        raise ConfigError(
            f"'{path}' is being served right now (PID {holder}), and a version is re-published here only with "
            "the server stopped. Roll back while it serves with "
            f'`POST /v1/admin/rollback {{"version": {args.version}{scenario}}}` (with its API token), '
            "or stop it and run this again."
        ) from None
    try:
        where = path if args.scenario is None else path / "scenarios" / args.scenario
        if not (where / FILENAME).is_file():
            served = sorted(p.name for p in (path / "scenarios").glob("*") if (p / FILENAME).is_file())
            raise ConfigError(
                f"'{path}' holds no chain for scenario '{args.scenario}'; the scenarios with one are "
                f"{', '.join(served) or 'none'} (serve.per_scenario keeps them in {path / 'scenarios'})"
            )
        chain = VersionChain(where)
        try:
            entry = chain.rollback_to(args.version)
        finally:
            chain.close()
    finally:
        lock.release()
    print(
        f"{path}: {'' if args.scenario is None else f'scenario {args.scenario!r} '}version {entry['version']} "
        f"re-published (was {entry['parent']}); "
        f"`headrace serve --resume --run-dir {path}` serves it",
        file=sys.stdout,
    )
    return 0


def _holder(lock: Path) -> int | None:
    """The PID of the live process whose PID the lock file holds, if any."""
    try:
        pid = int(lock.read_text(errors="replace").strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid
