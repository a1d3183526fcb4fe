"""``headrace``: run, list what is registered, and the subcommands other modules add.

A wrong name or a bad option is answered with one clear paragraph and exit status 2, never a
traceback from deep inside.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from headrace.engine import registry
from headrace.engine.config import ConfigError, RunConfig, build_config
from headrace.engine.episode import EnvContractError, PromptTooLongError
from headrace.engine.interrupt import EXIT_CODES
from headrace.engine.reward import TooManyDroppedGroups
from headrace.engine.rundir import RunDir

# Named flags → dotted config keys. Everything else is reachable with --set key=value.
FLAGS: list[tuple[str, str, type | None, str]] = [
    ("--env", "env", str, "env name (see `headrace envs`)"),
    ("--scheduler", "scheduler", str, "sync | stream | async"),
    ("--backend", "backend", str, "sim | torch | tinker (see `headrace backends`)"),
    ("--sampler", "sampler", str, "a separate sampling backend, e.g. vllm"),
    ("--model", "model", str, "'tiny' (embedded), a Hugging Face name, or a local directory"),
    ("--steps", "steps", int, "optimizer steps"),
    ("--group-size", "group_size", int, "samples per problem (G)"),
    ("--batch-size", "batch_size", int, "groups per step"),
    ("--seed", "seed", int, "random seed"),
    ("--run-dir", "run_dir", str, "where config.json, metrics.jsonl, log.jsonl and checkpoints go"),
    ("--max-steps-off-policy", "max_steps_off_policy", int, "async: how far sampling may run ahead"),
    ("--num-minibatches", "num_minibatches", int, "stream: forward_backward calls per step"),
    ("--lr", "optim.learning_rate", float, "learning rate"),
    ("--loss", "loss.name", str, "importance_sampling | ppo | cispo | cross_entropy"),
    ("--max-tokens", "sampling.max_tokens", int, "most tokens per action"),
    ("--temperature", "sampling.temperature", float, "sampling temperature"),
    ("--save-every", "save_every", int, "checkpoint every N steps"),
    ("--sampler-url", "vllm.sampler_url", str, "OpenAI-compatible vLLM server for --sampler vllm"),
    ("--tinker-url", "tinker.base_url", str, "Tinker service address (default: TINKER_BASE_URL)"),
    ("--tokenizer", "tinker.tokenizer", str, "local tokenizer path for the tinker backend"),
]

# Subcommands contributed by other modules (bench, plot, tinker-emulator): name -> (help, setup).
# setup(parser) adds arguments and sets `func` via parser.set_defaults(func=...).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("throughput benchmarks of the schedulers", "headrace.bench.cli:setup"),
    "plot": ("plot a run directory's metrics", "headrace.engine.plot:setup"),
    "tinker-emulator": ("serve a local emulator of the Tinker API", "headrace.backends.tinker_emulator.cli:setup"),
}


def _options_help(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    lines = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines += _options_help(annotation, f"{prefix}{name}.")
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
        epilog="every option (set with --set key=value or in the TOML file):\n" + "\n".join(_options_help()),
    )
    p.add_argument("--config", help="TOML file with any of the options below")
    for flag, dest, typ, text in FLAGS:
        p.add_argument(flag, dest=dest, type=typ, default=None, help=text)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="any option, dotted (e.g. sampling.temperature=0.7)")
    p.add_argument("--resume", action="store_const", const=True, default=None, help="continue the run in --run-dir from its last checkpoint")
    p.add_argument("--overwrite", action="store_const", const=True, default=None, help="replace the run in --run-dir")
    p.add_argument("--no-progress", dest="progress", action="store_const", const=False, default=None, help="no live display")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    import anyio

    from headrace.engine.progress import ProgressView
    from headrace.engine.run import train

    config = _config(args)
    registry.schedulers.get(config.scheduler)  # fail fast on a wrong name, before any set-up
    registry.backends.get(config.backend)
    registry.envs.get(config.env)
    with ProgressView(config.steps, enabled=config.progress) as view:
        summary = anyio.run(lambda: train(config, on_step=view.update, handle_signals=True))
    view.summary(RunDir(Path(summary.run_dir)).read_metrics(), summary.run_dir, summary.wall_s)
    if summary.stopped_by:
        print(f"headrace: stopped by {summary.stopped_by} after step {summary.steps}; "
              f"continue with --resume --run-dir {summary.run_dir}", file=sys.stderr)
        return EXIT_CODES[getattr(signal, summary.stopped_by)]
    return 0


def _lister(reg: registry.Registry) -> Callable[[argparse.Namespace], int]:
    def show(args: argparse.Namespace) -> int:
        for name in reg.names():
            print(name)
        return 0

    return show


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser; a contributed subcommand's module is imported only when it is the one asked
    for, so `headrace run` never pays for (or breaks on) bench, plot or the emulator."""
    parser = argparse.ArgumentParser(prog="headrace", description="asyncio actor-style RL for language models")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _run_parser(sub)
    for name, reg in (("envs", registry.envs), ("schedulers", registry.schedulers), ("backends", registry.backends)):
        sub.add_parser(name, help=f"list the registered {name}").set_defaults(func=_lister(reg))
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (text, target) in SUBCOMMANDS.items():
        parser_for_name = sub.add_parser(name, help=text, add_help=name == wanted)
        if name == wanted:
            module, _, attr = target.partition(":")
            getattr(importlib.import_module(module), attr)(parser_for_name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, registry.UnknownNameError) as e:
        print(f"headrace: error: {e}", file=sys.stderr)
        return 2
    except (EnvContractError, TooManyDroppedGroups, PromptTooLongError) as e:
        # the run started and failed for a reason the message explains; the run directory keeps
        # every step trained so far
        print(f"headrace: run failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("headrace: interrupted", file=sys.stderr)
        return 130


def run_config_from_args(argv: Sequence[str]) -> RunConfig:
    """The config `headrace run ARGS` would use (for tests and the bench harness)."""
    return _config(build_parser(["run"]).parse_args(["run", *argv]))


def _config(args: argparse.Namespace) -> RunConfig:
    flags: dict[str, Any] = {dest: getattr(args, dest) for _, dest, _, _ in FLAGS}
    flags |= {"resume": args.resume, "overwrite": args.overwrite, "progress": args.progress}
    return build_config(args.config, flags, args.overrides)
