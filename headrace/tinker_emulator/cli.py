"""``headrace tinker-emulator``: the argparse builder and entry point the CLI wires in."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys
from typing import NoReturn

from headrace.core.errors import ConfigError
from headrace.tinker_emulator.config import COMPUTES, EmulatorConfig, make_compute
from headrace.tinker_emulator.faults import Knobs

__all__ = ["add_arguments", "build_parser", "cli_main", "config_from_args", "make_compute", "setup"]

_HELP = {
    "latency_s": "server time added to every training op (s)",
    "sample_latency_s": "server time added to every sample request (s)",
    "clock_cycle_s": "lock-step clock cycle (s); training ops start only at cycle boundaries, and one that "
    "arrives after a boundary waits for the next; 0 = off",
    "follow_s": "a model's op arriving this soon after its previous one joins that op's cycle, though its "
    "boundary has passed (s); 0 = hard boundaries, as the service promises",
    "max_ops_per_cycle": "at most N forward/forward_backward/optim_step ops per model per cycle (2 = one "
    "forward_backward + optim_step pair); the rest of that model's queue waits for the next cycle, in order; "
    "0 = no cap",
    "long_poll_s": "how long retrieve_future holds a pending request before try_again (s)",
    "try_again_polls": "every future answers try_again this many times before its result",
    "http_5xx_every": "every Nth POST to an op endpoint starts a burst of 503s; 0 = never",
    "http_5xx_burst": "length of each 503 burst",
    "drop_every": "every Nth training submission is queued, then its response dropped; 0 = never",
    "drop_fetch_every": "every Nth retrieve_future of a finished result is dropped; 0 = never",
    "fail_after_apply_every": "every Nth optim_step is applied, then reported as a server error; 0 = never",
    "stall_every": "every Nth optim_step is applied, then its result held back for --stall-s; 0 = never",
    "stall_s": "how long a stalled result is held back (s)",
    "nan_loss_every": "every Nth forward_backward reports a NaN loss and poisons its step (lineage 'nan:'; "
    "bigram: a NaN gradient); 0 = never",
    "retry_after_ms": "retry-after-ms sent with injected 503s",
    "future_grace_s": "a future is forgotten this long after its result was first fetched (s)",
    "session_ttl_s": "a session with no heartbeat or request this long is evicted with its models; "
    "so is a sampling session unused this long (s)",
    "idle_connection_s": "a keep-alive connection with no request this long is closed (s)",
    "header_timeout_s": "a request's line and headers must arrive within this (s); 0 = no limit",
    "max_connections": "connections served at once (fewer if the open-file limit leaves room for fewer); "
    "past it, a new connection is answered 503",
    "max_body_mib": "a request body larger than this is answered 413 (MiB)",
    "log_records": "request-log records kept in memory for /emulator/log (--log FILE keeps all)",
}


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the emulator's options to ``parser`` (a subcommand parser of ``headrace``)."""
    defaults = EmulatorConfig()
    parser.add_argument("--host", default=defaults.host, help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=defaults.port, help="port (0 = pick a free one)")
    parser.add_argument(
        "--compute",
        default=defaults.compute,
        choices=list(COMPUTES),
        help="torch: headrace's torch backend on the --model weights, real training; bigram: numpy, instant",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="NAME",
        dest="models",
        help="a model to compute with (repeat for several; default: tiny): a registry name (tiny, smollm2-135m), "
        "a model directory or a .gguf file, as headrace run's --model; torch compute only. Every base-model name "
        "a client asks for is served: by the --model of that name, else by the first",
    )
    parser.add_argument(
        "--serve-only",
        nargs="+",
        default=None,
        metavar="NAME",
        help="answer only to these base-model names (default: any name); each is computed by the --model of "
        "that name, else by the first",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="the bigram compute's vocabulary: every token id below it is accepted (default: 65536); "
        "the torch compute's is its model's",
    )
    parser.add_argument(
        "--device", default=defaults.device, help="the torch compute's device: cpu, auto, cuda, cuda:N (default: cpu)"
    )
    parser.add_argument(
        "--dtype", default=defaults.dtype, choices=("auto", "float32", "bfloat16", "float16"),
        help="the torch compute's dtype (default: auto, the torch backend's choice for the model)",
    )  # fmt: skip
    parser.add_argument("--log", default=None, metavar="FILE", help="append the request log here as JSON lines")
    for f in dataclasses.fields(Knobs):
        if f.name == "http_5xx_ops":
            default = ",".join(Knobs.http_5xx_ops)
            parser.add_argument(
                "--http-5xx-ops",
                default=None,
                help=f"comma-separated endpoints where 503 bursts land (default: {default})",
            )
            continue
        parser.add_argument(
            f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, help=_HELP[f.name]
        )
    return parser


def setup(parser: argparse.ArgumentParser) -> None:
    """The hook ``headrace/app/cli.py`` calls for ``headrace tinker-emulator``."""
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog="headrace tinker-emulator", description=__doc__))


def _usage_error(message: str) -> NoReturn:
    print(f"headrace tinker-emulator: error: {message}", file=sys.stderr)
    raise SystemExit(2)  # a usage error: exit status 2, as argparse's own


def knobs_from_args(args: argparse.Namespace) -> Knobs:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(Knobs) if f.name != "http_5xx_ops"}
    if args.http_5xx_ops:
        values["http_5xx_ops"] = tuple(s.strip() for s in args.http_5xx_ops.split(",") if s.strip())
    try:
        return Knobs.from_dict(values)
    except ValueError as e:
        _usage_error(str(e))


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    """The emulator's config from its flags; a bad value exits 2 with one paragraph saying why."""
    values = {
        "host": args.host,
        "port": args.port,
        "compute": args.compute,
        "device": args.device,
        "dtype": args.dtype,
        "knobs": knobs_from_args(args),
        "log": args.log,
    }
    if args.models:
        values["models"] = tuple(args.models)
    if args.serve_only:
        values["serve_only"] = tuple(args.serve_only)
    if args.vocab_size is not None:
        values["vocab_size"] = args.vocab_size
    try:
        return EmulatorConfig.from_dict(values)
    except ValueError as e:
        _usage_error(str(e))


async def serve(config: EmulatorConfig) -> None:
    from headrace.tinker_emulator.server import Emulator

    try:
        emulator = Emulator.from_config(config)
    except ConfigError as e:  # a served model whose weights can't be found, a device that isn't here
        _usage_error(str(e))
    port = await emulator.start()
    url = config.url(port)
    names = ", ".join(config.serve_only) if config.serve_only else "any base-model name"
    print(
        f"Tinker emulator on {url} (compute: {config.compute}; models: {', '.join(emulator.compute.models)}; "
        f"answers to: {names})"
    )
    print(f"  export TINKER_BASE_URL={url} TINKER_API_KEY=tml-local", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await emulator.close()


def run_from_args(args: argparse.Namespace) -> int:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config_from_args(args)))
    return 0


def cli_main(argv: list[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(cli_main())
