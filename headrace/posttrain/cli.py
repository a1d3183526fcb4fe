"""``headrace sft`` and ``headrace dpo``: argument parsing; the recipes are ``sft.py`` and ``dpo.py``."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from pathlib import Path
from typing import Any

from headrace.run.backends import check as check_backends
from headrace.run.config import RunConfig, build_config
from headrace.run.rundir import RunDir

# flag, config key, type, help: what a post-training run shares with `headrace run`, and its own
SHARED: list[tuple[str, str, type, str]] = [
    ("--backend", "backend", str, "the training backend: torch | tinker"),
    ("--model", "model", str, "'tiny' (embedded), a Hugging Face name, or a local directory"),
    ("--renderer", "renderer", str, "messages <-> tokens (default: the model's)"),
    ("--run-dir", "run_dir", str, "where config.json, metrics.jsonl, log.jsonl and checkpoints go"),
    ("--seed", "seed", int, "random seed (the held-out split, the order of examples)"),
    ("--steps", "steps", int, "most optimizer steps (the run also stops after {name}.epochs passes)"),
    ("--lr", "optim.learning_rate", float, "learning rate"),
    ("--max-tokens", "sampling.max_tokens", int, "sdft: most tokens the student samples; --env: per answer"),
    ("--save-every", "checkpoint.every", int, "checkpoint every N steps (and at the end)"),
    ("--log", "log", str, "also send metrics to trackers: wandb, tensorboard or wandb,tensorboard"),
    ("--data", "{name}.data", str, "a JSONL or Parquet file of examples"),
    ("--test-data", "{name}.test_data", str, "held-out examples (default: {name}.test_fraction of --data)"),
    ("--batch-tokens", "{name}.batch_tokens", int, "tokens per step, at most"),
    ("--eval-every", "{name}.eval_every", int, "held-out loss every N steps (always at the start and the end)"),
    ("--env", "{name}.env", str, "an env whose held-out accuracy is measured at the start and the end"),
]

RECIPES = {"sft": ".sft:sft", "dpo": ".dpo:dpo", "sdft": ".sdft:sdft"}

DESCRIPTIONS = {
    "sft": 'Supervised fine-tuning on chat conversations ({"messages": [...]} or {"prompt", "completion"}), the '
    "loss on assistant tokens only (sft.train_on), batches by token budget, a held-out split's loss and, with "
    "--env, the env's held-out accuracy before and after. Same run directory, --resume, --log and --backend as "
    "`headrace run`; options as for it plus sft.* (--set sft.key=value).",
    "dpo": 'Direct preference optimisation on pairs ({"prompt", "chosen", "rejected"}, strings or messages) '
    "against the frozen reference (the starting weights; the base with the adapter off for LoRA): dpo.beta, "
    "preference accuracy, margins and the implicit rewards on the train batches and a held-out split.",
    "sdft": "Self-distillation fine-tuning on conversations whose last turn is a demonstration: the model with the "
    "demonstration in its prompt is the teacher; the model without it samples, and is trained toward the teacher's "
    "sdft.top_k next-token distribution at each sampled token. Held-out loss of the demonstrations; --env's accuracy.",
}


def _flags(name: str) -> list[tuple[str, str, Any, str]]:
    from headrace.app.cli import backend_flags

    return [(f, k.format(name=name), t, h.format(name=name)) for f, k, t, h in SHARED] + backend_flags()


def _setup(parser: argparse.ArgumentParser, name: str) -> None:
    from headrace.app.cli import options_help
    from headrace.plugins import registry

    parser.description = DESCRIPTIONS[name]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = f"{name}.* (--set {name}.key=value, or a [{name}] table in the TOML file):\n" + "\n".join(
        options_help(registry.sections.get(name), f"{name}.")
    )
    parser.add_argument("--config", help=f"TOML file with any option (a [{name}] table for {name}.*)")
    for flag, dest, typ, text in _flags(name):
        parser.add_argument(flag, dest=dest, type=typ, default=None, metavar=dest.rpartition(".")[2].upper(), help=text)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--resume", action="store_const", const=True, default=None,
                        help="continue the run in --run-dir from its last checkpoint")  # fmt: skip
    parser.add_argument("--overwrite", action="store_const", const=True, default=None,
                        help="replace the run in --run-dir")  # fmt: skip
    parser.add_argument("--no-progress", dest="progress", action="store_const", const=False, default=None,
                        help="no live line")  # fmt: skip
    parser.set_defaults(func=lambda args: cmd(args, name), recipe=name)


def setup_sft(parser: argparse.ArgumentParser) -> None:
    _setup(parser, "sft")


def setup_dpo(parser: argparse.ArgumentParser) -> None:
    _setup(parser, "dpo")


def setup_sdft(parser: argparse.ArgumentParser) -> None:
    _setup(parser, "sdft")


def config_of(args: argparse.Namespace, name: str) -> RunConfig:
    flags: dict[str, Any] = {dest: getattr(args, dest, None) for _, dest, _, _ in _flags(name)}
    flags |= {"resume": args.resume, "overwrite": args.overwrite, "progress": args.progress}
    saved = RunDir.saved_options(Path(args.run_dir)) if args.resume and args.run_dir else None
    # config.json records the recipe's section also where nothing in it was set
    return build_config(args.config, flags, args.overrides, base={name: {}, **(saved or {})})


def cmd(args: argparse.Namespace, name: str) -> int:
    config = config_of(args, name)
    check_backends(config)
    if config.run_dir is None:
        from headrace.run.rundir import default_run_dir

        config = config.model_copy(update={"run_dir": str(default_run_dir(config))})
    from .progress import StepProgress
    from .sft import summary

    recipe = RECIPES[name]
    module, _, attr = recipe.partition(":")
    run = getattr(importlib.import_module(module, __package__), attr)
    view = StepProgress(name, enabled=config.progress)
    try:
        s = asyncio.run(run(config, view))
    finally:
        view.end()
    print(summary(s), file=sys.stdout, flush=True)
    return 0
