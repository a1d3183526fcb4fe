"""The ``tinker`` backend: training and sampling on the Tinker service through the official SDK.

``make_backend(config)`` → an async context manager with ``.training`` (LoRA training client:
``forward_backward`` / ``optim_step`` pipelined, exactly-once recovery), ``.sampling`` (one
sampling client per published version, ``num_samples=n`` per call) and ``.tokenizer``.
Needs ``pip install 'headrace[tinker]'`` and ``TINKER_API_KEY``, or a local emulator
(``headrace tinker-emulator``) at ``--tinker-url`` / ``TINKER_BASE_URL``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from headrace.backends.tinker.connect import check_reachable, resolve, tokenizer_for
from headrace.backends.tinker.errors import TinkerRecoveryError
from headrace.backends.tinker.manifest import FILENAME, Manifest
from headrace.backends.tinker.sampling import TinkerSampling
from headrace.backends.tinker.training import TinkerTraining
from headrace.engine.config import RunConfig
from headrace.engine.types import SamplerHandle, Tokenizer

__all__ = ["FILENAME", "TinkerBackend", "TinkerRecoveryError", "make_backend"]


class TinkerBackend:
    def __init__(self, config: RunConfig):
        self.config = config
        self.base_url, self._api_key = resolve(config)  # no key and no emulator: fails here, clearly
        self.service: Any = None
        self.training: TinkerTraining = None  # type: ignore[assignment]
        self.sampling: TinkerSampling = None  # type: ignore[assignment]
        self.tokenizer: Tokenizer = None  # type: ignore[assignment]
        self._initial: SamplerHandle | None = None
        self._stack = contextlib.AsyncExitStack()  # holds the task group the training driver runs in
        self.manifest = Manifest.in_run_dir(config.run_dir, {
            "base_url": self.base_url, "base_model": config.model, "lora_rank": config.tinker.lora_rank,
        })

    async def __aenter__(self) -> TinkerBackend:
        try:
            return await self._start()
        except BaseException as e:
            await self.__aexit__(type(e), e, None)  # no session or driver left behind
            raise

    async def _start(self) -> TinkerBackend:
        import tinker

        await check_reachable(self.base_url)
        self.service = tinker.ServiceClient(base_url=self.base_url, api_key=self._api_key,
                                            user_metadata={"client": "headrace"})
        await asyncio.to_thread(lambda: self.service.holder)  # config + session: blocking calls
        self.training = TinkerTraining(self.service, self.config, self.manifest)
        tasks = await self._stack.enter_async_context(asyncio.TaskGroup())
        latest = self._resume_state()
        if latest is not None:
            client = await self.service.create_training_client_from_state_with_optimizer(latest["path"])
            self.training.start(tasks, client, committed=latest["path"], step=latest["step"])
            self.training.loaded_path = latest["path"]
        else:
            client = await self.service.create_lora_training_client(
                base_model=self.config.model, rank=self.config.tinker.lora_rank, seed=self.config.seed)
            self.training.start(tasks, client, committed=None)
            if self.config.tinker.commit_every:
                await self.training.commit("commit-000000", kind="commit")
        self.tokenizer = await asyncio.to_thread(tokenizer_for, self.config, client)
        self.sampling = TinkerSampling(self.tokenizer.eos_token_id)
        self._initial = await self.training.publish(self.training.steps_submitted)
        return self

    def _resume_state(self) -> dict[str, Any] | None:
        if not self.config.resume:
            return None
        states = self.manifest.data["states"]
        checkpoints = [s for s in states if s["kind"] == "checkpoint"]
        return (checkpoints or states or [None])[-1]

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            try:
                if self.training is not None and exc_type is None:
                    # let the last calls (e.g. a sampler save) land in the manifest
                    await asyncio.wait_for(self.training.drain(), self.config.tinker.request_timeout_s)
            finally:
                if self.training is not None:
                    self.training.stop()
                # awaits the driver and raises what it raised; the body's exception is not passed
                # in, since the task group would re-raise it wrapped in an ExceptionGroup
                await self._stack.aclose()
        except BaseException as e:
            await self._close_service(type(e))
            raise
        await self._close_service(exc_type)

    async def _close_service(self, exc_type: Any) -> None:
        if self.service is not None:
            status = "success" if exc_type is None else ("errored" if issubclass(exc_type, Exception) else "interrupted")
            try:
                await asyncio.wait_for(self.service.close(status), 30)
            except Exception:  # noqa: BLE001, S110 - closing the session is best effort
                pass

    def initial_handle(self) -> SamplerHandle:
        assert self._initial is not None, "enter the backend (async with) before asking for a handle"
        return self._initial

    def describe(self) -> dict[str, Any]:
        client = self.training.client if self.training else None
        return {
            "backend": "tinker", "base_url": self.base_url, "model": self.config.model,
            "lora_rank": self.config.tinker.lora_rank, "model_id": getattr(client, "model_id", None),
            "manifest": str(self.manifest.path) if self.manifest.path else None,
        }


def make_backend(config: RunConfig) -> TinkerBackend:
    return TinkerBackend(config)
