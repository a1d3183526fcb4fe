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
from pathlib import Path
from typing import Any

from headrace.backends.tinker.connect import check_reachable, hub_tokenizer, resolve, tokenizer_before_connecting
from headrace.backends.tinker.errors import TinkerNonFiniteError, TinkerRecoveryError, TinkerResumeError, is_uncertain
from headrace.backends.tinker.manifest import FILENAME, Manifest
from headrace.backends.tinker.sampling import TinkerSampling
from headrace.backends.tinker.training import TinkerTraining
from headrace.core.types import SamplerHandle, Tokenizer
from headrace.run.config import RunConfig

__all__ = [
    "FILENAME",
    "TinkerBackend",
    "TinkerNonFiniteError",
    "TinkerRecoveryError",
    "TinkerResumeError",
    "make_backend",
]


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
        self.manifest = Manifest.in_run_dir(
            config.run_dir,
            {
                "base_url": self.base_url,
                "base_model": config.model,
                "lora_rank": config.tinker.lora_rank,
            },
        )

    async def __aenter__(self) -> TinkerBackend:
        try:
            return await self._start()
        except BaseException as e:
            await self.__aexit__(type(e), e, None)  # no session or driver left behind
            raise

    async def _start(self) -> TinkerBackend:
        import tinker

        # before any session or model exists: a bad --tokenizer (or resume point) costs nothing
        tokenizer = await asyncio.to_thread(tokenizer_before_connecting, self.config)
        latest = self._resume_state()
        await check_reachable(self.base_url)
        self.service = tinker.ServiceClient(
            base_url=self.base_url, api_key=self._api_key, user_metadata={"client": "headrace"}
        )
        await asyncio.to_thread(lambda: self.service.holder)  # config + session: blocking calls
        self.training = TinkerTraining(self.service, self.config, self.manifest)
        tasks = await self._stack.enter_async_context(asyncio.TaskGroup())
        if latest is not None:
            client = await self._client_from(latest)
            self.training.start(tasks, client, committed=latest["path"], step=latest["step"])
            self.training.loaded_path = latest["path"]
        else:
            client = await self.service.create_lora_training_client(
                base_model=self.config.model, rank=self.config.tinker.lora_rank, seed=self.config.seed
            )
            self.training.start(tasks, client, committed=None)
            if self.config.tinker.commit_every:
                await self.training.commit("commit-000000", kind="commit")
        if tokenizer is None:
            tokenizer = await asyncio.to_thread(hub_tokenizer, self.config, client)
        self.tokenizer = tokenizer
        self.sampling = TinkerSampling(self.tokenizer.eos_token_id)
        self._initial = await self.training.publish(self.training.steps_submitted)
        return self

    def _resume_state(self) -> dict[str, Any] | None:
        """Where a resumed run continues: the run directory's latest checkpoint, the one the
        runner restores (so the client is made from it at once, with no throw-away model). Never
        a commit or a save the run directory did not record: those may hold steps the run does
        not continue from (steps after its last checkpoint, a step whose loss came back NaN).
        Without a run directory (the backend used on its own), the manifest's newest checkpoint."""
        if not self.config.resume:
            return None
        states = self.manifest.data["states"]
        if self.config.run_dir and (Path(self.config.run_dir) / "checkpoints").is_dir():
            from headrace.run.rundir import RunDir

            latest = RunDir(Path(self.config.run_dir)).latest_checkpoint()
            if latest is None:
                return None
            # the manifest's step counts optimizer steps (the names of the commits), the run dir's run steps
            step = next((s["step"] for s in reversed(states) if s["path"] == latest["path"]), latest["step"])
            return {"path": latest["path"], "step": step, "run_step": latest["step"]}
        checkpoints = [s for s in states if s["kind"] == "checkpoint"]
        return checkpoints[-1] if checkpoints else None

    async def _client_from(self, state: dict[str, Any]) -> Any:
        try:
            return await self.service.create_training_client_from_state_with_optimizer(state["path"])
        except Exception as e:
            if is_uncertain(e):
                raise
            body = getattr(e, "body", None)
            detail = (body.get("detail") or body.get("error")) if isinstance(body, dict) else None
            answer = f"HTTP {e.status_code} {type(e).__name__}" if hasattr(e, "status_code") else type(e).__name__
            raise TinkerResumeError(
                f"cannot resume: the Tinker service at {self.base_url} does not have the saved state "
                f"'{state['path']}' (step {state.get('run_step', state['step'])}) this run would continue from "
                f"(the service answered {answer}: {' '.join(str(detail or e).split())}). Saved states live on the "
                "service, not in the run directory: this one was deleted, expired, belongs to another account, or "
                "was saved on an emulator that has since restarted. No model was created on the service. Start over "
                "with --overwrite (or another --run-dir), or resume a run whose checkpoints the service still holds."
            ) from None

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
            status = (
                "success" if exc_type is None else ("errored" if issubclass(exc_type, Exception) else "interrupted")
            )
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
            "backend": "tinker",
            "base_url": self.base_url,
            "model": self.config.model,
            "lora_rank": self.config.tinker.lora_rank,
            "model_id": getattr(client, "model_id", None),
            "manifest": str(self.manifest.path) if self.manifest.path else None,
        }


def make_backend(config: RunConfig) -> TinkerBackend:
    return TinkerBackend(config)
