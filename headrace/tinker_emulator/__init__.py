"""A local Tinker emulator: the part of the Tinker HTTP API that the official SDK uses for
training, checkpoints and sampling, served on loopback and backed by headrace's ``torch``
backend (the embedded tiny model: training is real) or by a numpy bigram model (``--compute
bigram``: instant, for protocol tests).

Point the SDK (and ``headrace run --backend tinker``) at it::

    headrace tinker-emulator --port 8765 --clock-cycle-s 0.5 &
    TINKER_BASE_URL=http://127.0.0.1:8765 TINKER_API_KEY=tml-local headrace run --backend tinker

In tests: ``with EmulatorThread(knobs) as emu: ... emu.url ... emu.log()``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from typing import Any

from headrace.tinker_emulator.cli import build_parser, cli_main, make_compute
from headrace.tinker_emulator.compute import BigramCompute, Compute
from headrace.tinker_emulator.faults import Knobs
from headrace.tinker_emulator.server import Emulator

__all__ = [
    "BigramCompute",
    "Compute",
    "Emulator",
    "EmulatorThread",
    "Knobs",
    "build_parser",
    "cli_main",
    "make_compute",
]


class EmulatorThread:
    """The emulator on its own thread and event loop (the SDK has its own too)."""

    def __init__(
        self, knobs: Knobs | None = None, compute: str | Compute = "bigram", port: int = 0, log_path: str | None = None
    ):
        self.knobs = knobs or Knobs()
        self._compute = compute
        self._port = port
        self._log_path = log_path
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="tinker-emulator", daemon=True)
        self.emulator: Emulator | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        try:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            compute = make_compute(self._compute) if isinstance(self._compute, str) else self._compute
            self.emulator = Emulator(compute, self.knobs, self._log_path)
            self.port = await self.emulator.start(port=self._port)
        except BaseException as e:  # noqa: BLE001 - reported to the starting thread
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await self.emulator.close()

    def start(self) -> EmulatorThread:
        self._thread.start()
        self._ready.wait(120)
        if self._error is not None:
            raise RuntimeError(f"the Tinker emulator did not start: {self._error}") from self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)

    def __enter__(self) -> EmulatorThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _get(self, what: str) -> Any:
        with urllib.request.urlopen(f"{self.url}/emulator/{what}", timeout=30) as r:  # noqa: S310 - loopback
            return json.loads(r.read())

    def log(self) -> list[dict[str, Any]]:
        """Every request record: op, seq_id, model_id, cycle, submit/start/complete/fetch times."""
        return self._get("log")["records"]

    def models(self) -> dict[str, Any]:
        """Per model: steps applied and the lineage of step digests (a repeat = a double apply)."""
        return self._get("models")

    def set_knobs(self, **values: Any) -> None:
        req = urllib.request.Request(f"{self.url}/emulator/knobs", data=json.dumps(values).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=30):  # noqa: S310 - loopback
            pass
