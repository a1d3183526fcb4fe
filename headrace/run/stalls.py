"""A warning when one call holds the event loop. An env's code runs on the loop, so a blocking call
there (``time.sleep``, ``requests.get``, a long computation) stalls every rollout, the learner and
the sampler at once, and looks like a hang. A thread asks the loop for a heartbeat every
``CHECK_S``; when none came for ``STALL_S``, it reads the loop thread's stack and says which call
holds it, once per stall. What it costs the loop is one callback per ``CHECK_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import linecache
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from headrace.core import logs

log = logs.get_logger()
STALL_S = 5.0
CHECK_S = 0.5
_LIBRARIES = tuple(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib"))
_HEADRACE = str(Path(__file__).resolve().parent.parent) + os.sep
_ENGINE = f"{_HEADRACE}core{os.sep}"  # where the env's calls are made (episode, rollout)
# headrace's own work, not an env's: a stall there is the engine's or a backend's
_NOT_ENV = tuple(
    f"{_HEADRACE}{room}{os.sep}" for room in ("core", "run", "schedulers", "backends", "cluster", "viewer")
)


@contextlib.contextmanager
def warn_when_blocked(env: str | None, stall_s: float = STALL_S) -> Iterator[None]:
    """Watch the running loop while the block runs; ``env`` names the env whose code runs on it."""
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    context = contextvars.copy_context()  # the run's log file
    beat = [time.monotonic()]
    done = threading.Event()

    def on_loop() -> None:
        beat[0] = time.monotonic()

    def watch() -> None:
        held: FrameType | None = None  # the call seen holding the loop since ``since``
        since, warned = 0.0, False
        while not done.wait(CHECK_S):
            with contextlib.suppress(RuntimeError):  # the loop closed: the block is ending
                loop.call_soon_threadsafe(on_loop)
            now = time.monotonic()
            if now - beat[0] < 2 * CHECK_S:  # the loop had a turn lately
                held = None
                continue
            frame = sys._current_frames().get(loop_thread)
            culprit = _innermost_of_ours(frame) if frame is not None else None
            del frame
            if culprit is not held:  # a loop busy with many short calls is not one call holding it
                held, since, warned = culprit, beat[0] if held is None else now, False
            if held is not None and not warned and now - since >= stall_s:
                warned = True
                context.run(_warn, env, now - since, held)
        held = None

    watcher = threading.Thread(target=watch, name="headrace-stalls", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _warn(env: str | None, seconds: float, held: FrameType) -> None:
    where = f"{held.f_code.co_name} ({held.f_code.co_filename}:{held.f_lineno})"
    caller = _engine_call(held)
    in_env = not held.f_code.co_filename.startswith(_NOT_ENV)
    log.warning("event_loop_blocked", seconds=round(seconds, 1), call=where, caller=caller, env=env, in_env=in_env)
    if in_env:
        what = f"{where}{f', called from {caller}' if caller else ''}{f', in env {env}' if env else ''}"
        advice = (
            "Code that runs on the loop must not block: await instead (asyncio.sleep, an async client), or run "
            "the blocking work in a thread: `await asyncio.to_thread(f, ...)`."
        )
    else:
        what = f"{where}, headrace's own work"
        advice = "A very large batch or group can take the loop this long; a smaller one gives it back sooner."
    print(
        f"headrace: warning: one call has held the event loop for {seconds:.0f} s: {what}. Every rollout, the "
        f"learner and the sampler wait meanwhile. {advice}",
        file=sys.stderr,
        flush=True,
    )


def _ours(frame: FrameType) -> bool:
    """Code of headrace's or the user's: not the standard library, an installed package or generated code."""
    name = frame.f_code.co_filename
    return name.startswith(_HEADRACE) or not (name.startswith(_LIBRARIES) or name.startswith("<"))


def _innermost_of_ours(frame: FrameType) -> FrameType:
    current: FrameType | None = frame
    while current is not None:
        if _ours(current):
            return current
        current = current.f_back
    return frame


def _engine_call(held: FrameType) -> str | None:
    """The engine's line that called into ``held`` (an env's ``step``, ``make_envs``...), if one did."""
    if held.f_code.co_filename.startswith(_ENGINE):
        return None
    current = held.f_back
    while current is not None and not current.f_code.co_filename.startswith(_ENGINE):
        current = current.f_back
    if current is None:
        return None
    line = linecache.getline(current.f_code.co_filename, current.f_lineno).strip()
    return f"`{line}` ({Path(current.f_code.co_filename).name}:{current.f_lineno})" if line else None
