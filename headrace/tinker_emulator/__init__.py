"""A local Tinker emulator: the part of the Tinker HTTP API that the official SDK uses for
training, checkpoints and sampling, served on loopback and backed by headrace's ``torch``
backend (the ``--model`` models, by default the embedded tiny one: training is real) or by a
numpy bigram model (``--compute bigram``: fast, any token id below ``--vocab-size``, for
protocol tests). Any Tinker client runs against it unchanged: it answers to every base-model
name a client asks for (``Qwen/Qwen3-8B`` trains the tiny model) unless ``--serve-only``
restricts the names; it takes stop strings, returns prompt logprobs, and answers a token id
outside the model's vocabulary with a 400 naming its size. Clock cycles have hard boundaries
(an op that arrives after a boundary waits for the next); ``--max-ops-per-cycle 2`` models the
service conservatively (one ``forward_backward`` + ``optim_step`` per model per cycle). One
``EmulatorConfig`` (``config.py``) describes a server: the CLI builds it from its flags,
``EmulatorThread`` from its arguments.

Point the SDK (and ``headrace run --backend tinker``) at it::

    headrace tinker-emulator --port 8765 --clock-cycle-s 0.5 &
    TINKER_BASE_URL=http://127.0.0.1:8765 TINKER_API_KEY=tml-local headrace run --backend tinker

In tests: ``with EmulatorThread(knobs) as emu: ... emu.url ... emu.log()``, or
``EmulatorThread(config=EmulatorConfig(compute="torch", models=("smollm2-135m",), port=0))``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from typing import Any

from headrace.tinker_emulator.cli import build_parser, cli_main
from headrace.tinker_emulator.compute import Compute
from headrace.tinker_emulator.compute_bigram import BigramCompute
from headrace.tinker_emulator.config import EmulatorConfig, make_compute
from headrace.tinker_emulator.faults import Knobs
from headrace.tinker_emulator.server import Emulator

__all__ = [
    "BigramCompute",
    "Compute",
    "Emulator",
    "EmulatorConfig",
    "EmulatorThread",
    "Knobs",
    "build_parser",
    "cli_main",
    "make_compute",
]


class EmulatorThread:
    """The emulator on its own thread and event loop (the SDK has its own too).

    Built from an ``EmulatorConfig`` (``config=``), or from the arguments tests have always
    passed: ``EmulatorThread(knobs, compute="torch", models=["smollm2-135m"])``; these default to
    the bigram compute on a free port. ``compute`` may also be a ``Compute`` object of a test's
    own, which replaces the config's."""

    def __init__(
        self,
        knobs: Knobs | None = None,
        compute: str | Compute = "bigram",
        port: int = 0,
        log_path: str | None = None,
        *,
        models: tuple[str, ...] | list[str] | None = None,
        serve_only: tuple[str, ...] | list[str] = (),
        vocab_size: int | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        host: str = "127.0.0.1",
        config: EmulatorConfig | None = None,
    ):
        if config is None:
            values: dict[str, Any] = {
                "host": host,
                "port": port,
                "device": device,
                "dtype": dtype,
                "knobs": knobs,
                "log": log_path,
                "serve_only": tuple(serve_only),
                "vocab_size": vocab_size,
            }
            if isinstance(compute, str):
                values["compute"] = compute
            if models is not None:
                values["models"] = tuple(models)
            config = EmulatorConfig.from_dict(values)
        elif knobs is not None or models is not None or port or log_path is not None or serve_only or vocab_size:
            raise TypeError("pass either config= or the emulator's settings as arguments, not both")
        self.config = config
        self.knobs = config.knobs
        self._compute = None if isinstance(compute, str) else compute
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="tinker-emulator", daemon=True)
        self.emulator: Emulator | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return self.config.url(self.port)

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        try:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self.emulator = Emulator.from_config(self.config, self._compute)
            self.port = await self.emulator.start()
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

    def checkpoints(self) -> dict[str, Any]:
        """Per saved state (by path): its base model, its lineage, and whether it expires."""
        return self._get("checkpoints")

    def set_knobs(self, **values: Any) -> None:
        req = urllib.request.Request(f"{self.url}/emulator/knobs", data=json.dumps(values).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=30):  # noqa: S310 - loopback
            pass
