"""One worker thread that owns the device: every job runs on it, in submission order.

A submit returns an asyncio future at once, so the learner can queue ``optim_step`` and the next
``forward_backward`` before awaiting the first: the device never waits on Python, and the
event loop (rollouts, rewards, data prep) keeps running while torch computes (its kernels
release the GIL).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class DeviceThread:
    def __init__(self, name: str = "headrace-device", num_threads: int = 0):
        self._name = name
        self._num_threads = num_threads
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self) -> None:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=self._name, initializer=self._init_thread
            )

    def _init_thread(self) -> None:
        if self._num_threads > 0:
            import torch

            torch.set_num_threads(self._num_threads)

    def submit_threadsafe(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        if self._executor is None:
            raise RuntimeError("the torch backend is not running; use it inside `async with backend:`")
        # in the submitter's context, so what a job logs goes to the log of the run that sent it
        return self._executor.submit(contextvars.copy_context().run, fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue ``fn(*args)`` behind everything submitted before; must be called on the event loop."""
        return asyncio.wrap_future(self.submit_threadsafe(fn, *args))

    def shutdown(self) -> None:
        """Finish the queued jobs, then stop the thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=False)
            self._executor = None


class Answers:
    """Results gathered on the device thread, sent to each future's loop in one callback: the
    tasks they wake run in this order, all before anything that one of them starts (a sampler's
    batches then form the same way in every run, ``sampler.py``)."""

    def __init__(self) -> None:
        self._items: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, Any, BaseException | None]] = []

    def give(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any) -> None:
        self._items.append((loop, future, value, None))

    def fail(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, exc: BaseException) -> None:
        self._items.append((loop, future, None, exc))

    def send(self) -> None:
        items, self._items = self._items, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, Any, BaseException | None]]] = {}
        for loop, future, value, exc in items:
            by_loop.setdefault(loop, []).append((future, value, exc))
        for loop, some in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle, some)
            except RuntimeError:  # the loop is closed: the run is over
                pass


def _settle(items: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    for future, value, exc in items:
        if future.done():  # cancelled meanwhile: nobody is waiting
            continue
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(value)
