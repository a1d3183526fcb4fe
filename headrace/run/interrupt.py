"""Ctrl-C and pre-emption: the first SIGINT/SIGTERM asks the run (or the service) to stop at the
next step boundary (a run then checkpoints and exits 130/143); a second one exits at once,
whatever the event loop is doing, leaving the directory as kill -9 would (``--resume`` goes on).

The signals are read on a thread of their own. CPython's C-level handler writes each signal's
number to a pipe (``signal.set_wakeup_fd``) the moment it arrives, and the thread reading it acts.
Neither of the usual ways would do: ``loop.add_signal_handler`` waits for the event loop to get a
turn (never, while an env blocks it with ``time.sleep`` or a huge batch keeps it busy for minutes,
and its wakeup socket fills up meanwhile), and a Python handler runs only on the main thread,
between bytecodes, so not while that thread is inside a long C call that released the GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
STOPPING = "finishing the current step and saving a checkpoint"


@contextlib.contextmanager
def stop_on_signals(
    request_stop: Callable[[], None], enabled: bool = True, stopping: str = STOPPING
) -> Iterator[dict[str, str]]:
    """Yields a dict that holds ``signal`` once one arrived. ``request_stop`` is called on the
    event loop; ``stopping`` says what the process does before it exits."""
    seen: dict[str, str] = {}
    if not enabled:
        yield seen
        return
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:  # on the watching thread
        if seen:
            _say(f"\nheadrace: second {sig.name}, exiting now without a checkpoint\n")
            os._exit(EXIT_CODES[sig])
        seen["signal"] = sig.name
        _say(f"\nheadrace: {sig.name}: {stopping} (again to exit now)\n")
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: it is stopping anyway
            loop.call_soon_threadsafe(request_stop)

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # the C handler must never block
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    # a Python handler must be set for the C one to run; the thread does the work, so it does nothing
    previous = {sig: signal.signal(sig, _noop) for sig in EXIT_CODES}
    watcher = threading.Thread(
        target=_watch, args=(read_end, previous_fd, on_signal), name="headrace-signals", daemon=True
    )
    watcher.start()
    try:
        yield seen
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(previous_fd)
        os.close(write_end)  # the thread reads the end of the pipe and returns
        watcher.join()
        os.close(read_end)


def _watch(read_end: int, previous_fd: int, on_signal: Callable[[signal.Signals], None]) -> None:
    while data := os.read(read_end, 64):
        for number in data:
            if number in EXIT_CODES.keys():
                on_signal(signal.Signals(number))
            elif previous_fd >= 0:  # another signal, for whoever set the wakeup fd before (asyncio)
                with contextlib.suppress(OSError):
                    os.write(previous_fd, bytes([number]))


def _noop(signum: int, frame: object) -> None:
    pass


def _say(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, text.encode())  # not print(): no lock a stuck main thread may hold
