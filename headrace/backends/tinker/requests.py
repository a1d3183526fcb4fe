"""The training driver's units: an ``Op`` (one SDK request, and what its result becomes for the
engine) and the ``forward_backward`` calls held until their step closes, which go out merged as
one request and hand each call back its own part."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from headrace.backends.tinker import convert
from headrace.core.types import Datum, ForwardBackwardResult


@dataclass(eq=False)
class Op:
    kind: str
    send: Callable[[Any], Any]  # training client -> SDK future
    finish: Callable[[Any], Any]  # SDK result -> what the engine gets
    replay: bool  # changes the training state: re-run on recovery even if it had resolved
    out: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    sdk: Any = None
    gen: int = -1  # the client generation it was last sent on
    step: int = 0  # optim steps submitted before it (its own included, for an optim_step)


@dataclass(eq=False)
class Held:
    """A ``forward_backward`` the engine made, not sent yet: it goes out with the rest of its step."""

    data: list[Any]  # the SDK's datums
    datums: list[Datum]
    loss: str
    config: dict[str, float] | None
    out: asyncio.Future[ForwardBackwardResult] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclass
class Merged:
    """A merged ``forward_backward`` request's result, one part per call it carried."""

    parts: list[ForwardBackwardResult]

    @property
    def metrics(self) -> dict[str, float]:  # the request's own: checked for non-finite values
        return self.parts[0].metrics


class HeldResult:
    """What ``forward_backward`` returns. Awaiting it sends the held call at once: a caller that
    waits for a ``forward_backward`` before its ``optim_step`` would otherwise wait forever."""

    __slots__ = ("_flush", "_out")

    def __init__(self, out: asyncio.Future[ForwardBackwardResult], flush: Callable[[], None]):
        self._out, self._flush = out, flush

    def __await__(self) -> Generator[Any, None, ForwardBackwardResult]:
        self._flush()
        return self._out.__await__()


def pass_on(source: asyncio.Future[Any], target: asyncio.Future[Any], result: Callable[[Any], Any]) -> None:
    """``source``'s outcome to ``target``: its error or cancellation as it is, its value through ``result``."""
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif (error := source.exception()) is not None:
        target.set_exception(error)
    else:
        target.set_result(result(source.result()))


def _part(i: int) -> Callable[[Merged], ForwardBackwardResult]:
    return lambda merged: merged.parts[i]


def hand_back(held: list[Held], merged: asyncio.Future[Any]) -> None:
    """The merged request's outcome, to each call it carried."""
    for i, h in enumerate(held):
        pass_on(merged, h.out, _part(i))


def merged(held: list[Held]) -> Op:
    """One ``forward_backward`` request carrying every held call (one loss and config)."""
    data, calls = [x for h in held for x in h.data], [h.datums for h in held]
    loss, cfg = held[0].loss, held[0].config
    return Op(
        "forward_backward",
        lambda tc: tc.forward_backward(data, loss, cfg),
        lambda result: Merged(convert.fb_results(result, calls)),
        replay=True,
    )
