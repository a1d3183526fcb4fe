"""``headrace``: run, list what is registered, and the subcommands other modules add.

Every failure is answered with one clear paragraph, never a traceback from deep inside (``--debug``
shows it): exit status 2 for a wrong name, option or path (usage and configuration), 1 for a run
that started and failed, 130/143 for SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from headrace.app.failures import explain
from headrace.app.usage import CommandLineError, Parser
from headrace.plugins import registry
from headrace.run.backends import check as check_backends
from headrace.run.config import RunConfig, build_config
from headrace.run.interrupt import EXIT_CODES
from headrace.run.rundir import RunDir, default_run_dir
from headrace.run.scheduling import make_scheduler

# Named flags → dotted config keys (a backend's own flags come from its plugin: backend_flags()).
# Everything else is reachable with --set key=value.
FLAGS: list[tuple[str, str, type | None, str]] = [
    ("--env", "env", str, "env name (see `headrace envs`), or FILE.py:NAME / package.module:NAME"),
    ("--scheduler", "scheduler", str, "sync | stream | async | inflight (see `headrace schedulers`)"),
    ("--backend", "backend", str, "the training backend: sim | torch | tinker | ... (see `headrace backends`)"),
    ("--sampler", "sampler", str, "a sampler backend that samples for it, e.g. vllm (see `headrace backends`)"),
    ("--cluster", "cluster.kind", str, "none (one process) | ray (rollout workers, sampler replicas, learner in Ray)"),
    ("--model", "model", str, "'tiny' (embedded), a Hugging Face name, or a local directory"),
    (
        "--renderer",
        "renderer",
        str,
        "messages <-> tokens: chat_template, role_colon, tiny, plain_text (default: the model's)",
    ),
    ("--steps", "steps", int, "optimizer steps"),
    ("--group-size", "group_size", int, "samples per problem (G)"),
    ("--batch-size", "batch_size", int, "groups per step"),
    ("--seed", "seed", int, "random seed"),
    ("--run-dir", "run_dir", str, "where config.json, metrics.jsonl, log.jsonl and checkpoints go"),
    ("--max-steps-off-policy", "max_steps_off_policy", int, "async: how far sampling may run ahead"),
    ("--num-minibatches", "num_minibatches", int, "stream: forward_backward calls per step"),
    ("--lr", "optim.learning_rate", float, "learning rate"),
    ("--loss", "loss.name", str, "importance_sampling, ppo, cispo, gspo, tis, mis, decoupled_ppo, cross_entropy"),
    ("--max-tokens", "sampling.max_tokens", int, "most tokens per action"),
    ("--temperature", "sampling.temperature", float, "sampling temperature"),
    ("--save-every", "checkpoint.every", int, "checkpoint every N steps (the newest checkpoint.keep_last are kept)"),
    ("--log", "log", str, "also send metrics to trackers: wandb, tensorboard or wandb,tensorboard"),
]

# Subcommands contributed by other modules (bench, plot, tinker-emulator): name -> (help, setup).
# setup(parser) adds arguments and sets `func` via parser.set_defaults(func=...).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("throughput benchmarks of the schedulers", "headrace.bench.cli:setup"),
    "check": (
        "checks of a model on this machine: numerics (sampler vs learner logprobs)",
        "headrace.bench.numerics:setup",
    ),
    "plot": ("plot a run directory's metrics", "headrace.app.plot:setup"),
    "tinker-emulator": ("serve a local emulator of the Tinker API", "headrace.tinker_emulator.cli:setup"),
    "view": ("write an HTML page to browse a run's steps and sampled completions", "headrace.viewer.cli:setup"),
    "serve": ("serve a model (OpenAI-compatible) and learn from feedback on it", "headrace.serve.cli:setup"),
    "rollback": ("re-publish an earlier version of a served model", "headrace.serve.cli:setup_rollback"),
}


def backend_flags() -> list[tuple[str, str, type | None, str]]:
    """The backends' own flags (their plugins'), as FLAGS rows setting keys of their sections. A
    flag that a run-wide option or an earlier backend already has is left out (--set reaches it)."""
    from headrace.core.protocols import BackendPlugin
    from headrace.plugins.backends import plugins

    taken = {flag for flag, *_ in FLAGS} | {"--config", "--set", "--resume", "--overwrite", "--no-progress"}
    rows: list[tuple[str, str, type | None, str]] = []
    for name, plugin in plugins():
        if not isinstance(plugin, BackendPlugin):
            continue
        for flag, key, typ, text in plugin.flags:
            if flag not in taken:
                taken.add(flag)
                rows.append((flag, f"{name}.{key}", typ, f"{text} (= --set {name}.{key}=...)"))
    return rows


def _backend_options_help() -> list[str]:
    """Each backend's section, for the epilog: ``[NAME]`` in a TOML file, ``--set NAME.key=value``."""
    from headrace.core.protocols import BackendPlugin
    from headrace.plugins.backends import plugins

    lines = []
    for name, plugin in plugins():
        if isinstance(plugin, BackendPlugin):
            lines += options_help(plugin.config, f"{name}.")
        else:
            lines.append(f"  {name}.*  (cannot load this backend: {type(plugin).__name__}: {plugin})".splitlines()[0])
    return lines


def options_help(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """``model``'s options, one line each: ``PREFIX.name = default  description``."""
    lines = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines += options_help(annotation, f"{prefix}{name}.")
            continue
        default = field.get_default(call_default_factory=True)
        desc = f"  {field.description}" if field.description else ""
        lines.append(f"  {prefix}{name} = {default!r}{desc}")
    return lines


def _run_parser(sub) -> None:
    p = sub.add_parser(
        "run",
        help="train: env x scheduler x backend",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a policy with RL. Defaults < --config FILE < named flags < --set key=value.",
        epilog="every option (set with --set key=value or in the TOML file):\n"
        + "\n".join(options_help())
        + "\nbackend sections (--set NAME.key=value, or a [NAME] table in the TOML file):\n"
        + "\n".join(_backend_options_help()),
    )
    p.add_argument("--config", help="TOML file with any of the options below")
    for flag, dest, typ, text in [*FLAGS, *backend_flags()]:
        metavar = dest.rpartition(".")[2].upper()  # a backend's: its key (BASE_URL), not TINKER.BASE_URL
        p.add_argument(flag, dest=dest, type=typ, default=None, metavar=metavar, help=text)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any option, dotted (e.g. sampling.temperature=0.7)",
    )
    p.add_argument(
        "--resume",
        action="store_const",
        const=True,
        default=None,
        help="continue the run in --run-dir from its last checkpoint, with its options (--steps extends)",
    )
    p.add_argument(
        "--overwrite",
        action="store_const",
        const=True,
        default=None,
        help="replace the run in --run-dir (only a directory that holds a headrace run)",
    )
    p.add_argument(
        "--no-progress", dest="progress", action="store_const", const=False, default=None, help="no live display"
    )
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from headrace.app.progress import run_with_progress
    from headrace.run.train import check_names

    config = _config(args)
    make_scheduler(config)  # fail fast on a wrong name or setting, before any set-up
    check_backends(config)
    check_names(config)  # a wrong model name, env name or option, before the run directory is named
    summary = run_with_progress(config)
    return EXIT_CODES[getattr(signal, summary.stopped_by)] if summary.stopped_by else 0


def _list_backends(args: argparse.Namespace) -> int:
    """One line a backend: name, kind, what it is, and what it still needs here."""
    from headrace.core.protocols import BackendPlugin
    from headrace.plugins.backends import plugins

    found = plugins()
    width = max((len(name) for name, _ in found), default=0)
    for name, plugin in found:
        if not isinstance(plugin, BackendPlugin):
            line = f"(cannot load: {type(plugin).__name__}: {plugin})".splitlines()[0]
            print(f"{name:<{width}}  {'?':<8}  {line}")
            continue
        missing = plugin.missing()
        needs = f" [needs {', '.join(missing)}: {plugin.install or 'install them'}]" if missing else ""
        print(f"{name:<{width}}  {plugin.kind:<8}  {plugin.description}{needs}".rstrip())
    return 0


def _lister(reg: registry.Registry) -> Callable[[argparse.Namespace], int]:
    def show(args: argparse.Namespace) -> int:
        names = reg.names()
        width = max(map(len, names), default=0)
        for name in names:
            print(f"{name:<{width}}  {reg.describe(name)}".rstrip())
        return 0

    return show


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser; a contributed subcommand's module is imported only when it is the one asked
    for, so `headrace run` never pays for (or breaks on) bench, plot or the emulator."""
    parser = Parser(prog="headrace", description="asyncio actor-style RL for language models")
    parser.add_argument("--version", action="version", version=f"headrace {_version()}")
    parser.add_argument("--debug", action="store_true", help="on failure, show the full traceback")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _run_parser(sub)
    for name, reg in (("envs", registry.envs), ("schedulers", registry.schedulers)):
        sub.add_parser(name, help=f"list the registered {name} with a line on each").set_defaults(func=_lister(reg))
    backends_help = "list the backends (training and sampler) with a line on each"
    sub.add_parser("backends", help=backends_help).set_defaults(func=_list_backends)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (text, target) in SUBCOMMANDS.items():
        parser_for_name = sub.add_parser(name, help=text, add_help=name == wanted)
        if name == wanted:
            module, _, attr = target.partition(":")
            getattr(importlib.import_module(module), attr)(parser_for_name)
    for subparser in sub.choices.values():
        # also after the command (`headrace run ... --debug`); SUPPRESS keeps a global one
        subparser.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="on failure, show the full traceback"
        )
    return parser


def _version() -> str:
    try:
        return version("headrace")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(argv).parse_args(argv)
    except CommandLineError as error:
        print(f"headrace: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    run_dir: str | None = None
    try:
        if args.func is cmd_run:
            # name the run directory now, so a failure can say where it stands
            config = _config(args)
            run_dir = config.run_dir
            if run_dir is None:
                args.run_dir = run_dir = str(default_run_dir(config))
        return int(args.func(args) or 0)
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as raised:  # noqa: BLE001 - the one place a failure becomes a paragraph
        if args.debug:
            traceback.print_exception(raised)
        code, text = explain(raised, args.command, run_dir, args.debug)
        if text:
            print(" ".join(text.split()), file=sys.stderr)
        return code


def run_config_from_args(argv: Sequence[str]) -> RunConfig:
    """The config `headrace run ARGS` would use (for tests and the bench harness)."""
    return _config(build_parser(["run"]).parse_args(["run", *argv]))


def _config(args: argparse.Namespace) -> RunConfig:
    flags: dict[str, Any] = {dest: getattr(args, dest, None) for _, dest, _, _ in [*FLAGS, *backend_flags()]}
    flags |= {"resume": args.resume, "overwrite": args.overwrite, "progress": args.progress}
    # `--resume --run-dir D` continues D with the options it was started with; options given
    # explicitly go on top, and the run directory refuses (listing both values) where they differ
    base = RunDir.saved_options(Path(args.run_dir)) if args.resume and args.run_dir else None
    return build_config(args.config, flags, args.overrides, base=base)
