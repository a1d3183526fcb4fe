"""Ctrl-C and pre-emption: the first SIGINT/SIGTERM asks the learner to stop at the next step
boundary (the run then checkpoints and exits 130/143); a second one exits at once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


@contextlib.contextmanager
def stop_on_signals(request_stop: Callable[[], None], enabled: bool = True) -> Iterator[dict[str, str]]:
    """Yields a dict that holds ``signal`` once one arrived."""
    seen: dict[str, str] = {}
    if not enabled:
        yield seen
        return
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if seen:
            print(f"\nheadrace: second {sig.name}, exiting now without a checkpoint", file=sys.stderr, flush=True)
            os._exit(EXIT_CODES[sig])
        seen["signal"] = sig.name
        print(
            f"\nheadrace: {sig.name}: finishing the current step and saving a checkpoint (again to exit now)",
            file=sys.stderr,
            flush=True,
        )
        request_stop()

    for sig in EXIT_CODES:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        yield seen
    finally:
        for sig in EXIT_CODES:
            loop.remove_signal_handler(sig)
