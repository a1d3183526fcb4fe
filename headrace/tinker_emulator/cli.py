"""``headrace tinker-emulator``: the argparse builder and entry point the CLI wires in."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys

from headrace.tinker_emulator.compute import BigramCompute, Compute
from headrace.tinker_emulator.faults import Knobs

_HELP = {
    "latency_s": "server time added to every training op (s)",
    "sample_latency_s": "server time added to every sample request (s)",
    "clock_cycle_s": "lock-step clock cycle (s); training ops start only at cycle boundaries; 0 = off",
    "follow_s": "a model's op arriving this soon after its previous one joins that op's cycle (s)",
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
    "max_body_mib": "a request body larger than this is answered 413 (MiB)",
    "log_records": "request-log records kept in memory for /emulator/log (--log FILE keeps all)",
}


def make_compute(name: str) -> Compute:
    if name == "bigram":
        return BigramCompute()
    if name == "torch":
        from headrace.tinker_emulator.compute_torch import TorchCompute

        return TorchCompute()
    raise ValueError(f"unknown emulator compute '{name}'; use 'torch' or 'bigram'")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the emulator's options to ``parser`` (a subcommand parser of ``headrace``)."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=8765, help="port (0 = pick a free one)")
    parser.add_argument(
        "--compute",
        default="torch",
        choices=["torch", "bigram"],
        help="torch: the embedded tiny model, real training; bigram: numpy, instant",
    )
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


def knobs_from_args(args: argparse.Namespace) -> Knobs:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(Knobs) if f.name != "http_5xx_ops"}
    if args.http_5xx_ops:
        values["http_5xx_ops"] = tuple(s.strip() for s in args.http_5xx_ops.split(",") if s.strip())
    try:
        return Knobs.from_dict(values)
    except ValueError as e:  # a usage error: exit status 2, as argparse's own
        print(f"headrace tinker-emulator: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


async def serve(args: argparse.Namespace) -> None:
    from headrace.tinker_emulator.server import Emulator

    emulator = Emulator(make_compute(args.compute), knobs_from_args(args), args.log)
    port = await emulator.start(args.host, args.port)
    print(f"Tinker emulator on http://{args.host}:{port} (compute: {args.compute})", flush=True)
    print(f"  export TINKER_BASE_URL=http://{args.host}:{port} TINKER_API_KEY=tml-local", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await emulator.close()


def run_from_args(args: argparse.Namespace) -> int:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args))
    return 0


def cli_main(argv: list[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(cli_main())
