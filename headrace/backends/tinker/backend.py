"""The tinker backend's wiring: service, training client, sampling clients and the manifest."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from pathlib import Path
from typing import Any

from headrace.backends.tinker.adapters import LocalAdapters, TinkerSamplerWeights
from headrace.backends.tinker.connect import (
    check_reachable,
    hub_tokenizer,
    local_model_dir,
    resolve,
    tokenizer_before_connecting,
)
from headrace.backends.tinker.errors import (
    TinkerNonFiniteError,
    TinkerRecoveryError,
    TinkerResumeError,
    is_uncertain,
    service_answer,
    service_detail,
)
from headrace.backends.tinker.manifest import FILENAME, Manifest
from headrace.backends.tinker.sampling import TinkerSampling
from headrace.backends.tinker.training import TinkerTraining
from headrace.core.errors import ConfigError
from headrace.core.protocols import BackendContext
from headrace.core.types import SamplerHandle, Tokenizer

from .config import TinkerConfig

__all__ = [
    "FILENAME",
    "TinkerBackend",
    "TinkerNonFiniteError",
    "TinkerRecoveryError",
    "TinkerResumeError",
    "make_backend",
]


class TinkerBackend:
    def __init__(self, config: TinkerConfig, ctx: BackendContext):
        self.config, self.ctx = config, ctx
        self.base_url, self._api_key = resolve(config)  # no key and no emulator: fails here, clearly
        self.service: Any = None
        self.training: TinkerTraining = None  # type: ignore[assignment]
        self.sampling: TinkerSampling = None  # type: ignore[assignment]
        self.tokenizer: Tokenizer = None  # type: ignore[assignment]
        self._initial: SamplerHandle | None = None
        self._local: Path | None = None  # sample_locally: where the versions' adapters are kept
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stack = contextlib.AsyncExitStack()  # holds the task group the training driver runs in
        self.manifest = Manifest.in_run_dir(
            ctx.run_dir,
            {
                "base_url": self.base_url,
                "base_model": ctx.model,
                "lora_rank": config.lora_rank,
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
        tokenizer = await asyncio.to_thread(tokenizer_before_connecting, self.config, self.ctx.model)
        latest = self._resume_state()
        await check_reachable(self.base_url)
        self.service = tinker.ServiceClient(
            base_url=self.base_url, api_key=self._api_key, user_metadata={"client": "headrace"}
        )
        await asyncio.to_thread(lambda: self.service.holder)  # config + session: blocking calls
        self._loop = asyncio.get_running_loop()
        self.training = TinkerTraining(self.service, self.config, self.manifest)
        if self._local is not None:
            self.training.adapters = await asyncio.to_thread(self._adapters, self._local, resumed=self.ctx.resume)
        self.training.base_model = self.ctx.model
        tasks = await self._stack.enter_async_context(asyncio.TaskGroup())
        if latest is not None:
            client = await self._client_from(latest)
            self.training.start(tasks, client, committed=latest["path"], step=latest["step"])
            self.training.loaded_path = latest["path"]
        else:
            try:
                client = await self.service.create_lora_training_client(
                    base_model=self.ctx.model, rank=self.config.lora_rank, seed=self.ctx.seed
                )
            except tinker.APIStatusError as e:
                if e.status_code not in (400, 404, 422):
                    raise
                raise ConfigError(  # a model or rank the service refuses: nothing was created
                    f"the Tinker service at {self.base_url} refused to create a LoRA model of '{self.ctx.model}' "
                    f"(rank {self.config.lora_rank}): {service_detail(e)}. Pick a base model and rank it serves "
                    "(--model, --set tinker.lora_rank=N)."
                ) from None
            self.training.start(tasks, client, committed=None)
            if self.config.commit_every:
                await self.training.commit("commit-000000", kind="commit")
        if tokenizer is None:
            tokenizer = await asyncio.to_thread(hub_tokenizer, self.ctx.model, client)
        self.tokenizer = tokenizer
        self.sampling = TinkerSampling(self.tokenizer.eos_token_id, self.service)
        self._initial = await self.training.publish(self.training.steps_submitted)
        return self

    # -- local sampling (--sampler vllm) and exports ------------------------------------------

    def sample_locally(self, directory: Path) -> None:
        """Publish each version as sampler weights a local sampler downloads, keeping the adapters
        in ``directory`` (``ServesLocally``; before the backend is entered)."""
        self._local = Path(directory)

    def _adapters(self, directory: Path, resumed: bool) -> LocalAdapters:
        import tinker

        rest = tinker.RestClient(base_url=self.base_url, api_key=self._api_key)
        adapters = LocalAdapters(directory, self.manifest, rest, self.ctx.model, self.config.lora_rank, 32.0)
        if resumed:
            # the version resumed from (a run's step, a service's incumbent); those after it are
            # trained again, so their adapters are not these
            version = self.ctx.resume_checkpoint[0] if self.ctx.resume_checkpoint else -1
            adapters.forget_after(version)
            adapters.check(version)  # the version served first after a restart: refused now if it was altered
        return adapters

    def export_base_model(self, directory: Any) -> str:
        """The base model's local directory: what a local sampler applies each version's adapter to."""
        found = local_model_dir(self.ctx.model)
        if found is None and self.ctx.model != "tiny":
            from headrace.models import model_dir

            found = model_dir(self.ctx.model)  # a hub name: the local cache, or a download
        if found is None:
            raise ConfigError(
                f"--backend tinker --sampler vllm samples with the base model '{self.ctx.model}' on this machine, and "
                "'tiny' is built in code, not a model directory vLLM loads. Use a Hugging Face model the service "
                "trains (--model Qwen/Qwen3-8B, in the local Hugging Face cache) or a model directory the emulator "
                "serves (headrace tinker-emulator --model DIR, and --model DIR here)."
            )
        return str(found)

    def export_weights(self, handle: SamplerHandle, directory: Any) -> str:
        """``handle``'s version as a PEFT adapter directory (``ExportsWeights``, from a thread): its
        sampler weights downloaded from the service and converted. A handle without a path (an
        ephemeral sampling client) saves the current weights first: the version just published."""
        ref = handle.ref
        if not isinstance(ref, TinkerSamplerWeights):
            assert self._loop is not None, "enter the backend (async with) before exporting"
            path = asyncio.run_coroutine_threadsafe(self._saved(f"export-{handle.version:06d}"), self._loop).result(
                self.config.request_timeout_s
            )
            with tempfile.TemporaryDirectory(prefix="headrace-export-") as scratch:
                adapters = self._adapters(Path(scratch), resumed=False)
                adapters.manifest = Manifest(None, {})  # a one-off download, recorded nowhere
                return str(TinkerSamplerWeights(handle.version, path, adapters).save(directory))
        return str(ref.save(directory))

    async def _saved(self, name: str) -> str:
        return await self.training.save_sampler_weights(name)

    def _resume_state(self) -> dict[str, Any] | None:
        """Where a resumed run continues: the run directory's latest checkpoint, the one the
        runner restores (so the client is made from it at once, with no throw-away model). Never
        a commit or a save the run directory did not record: those may hold steps the run does
        not continue from (steps after its last checkpoint, a step whose loss came back NaN).
        Without a run directory (the backend used on its own), the manifest's newest checkpoint."""
        if not self.ctx.resume:
            return None
        states = self.manifest.data["states"]
        if self.ctx.run_dir and (Path(self.ctx.run_dir) / "checkpoints").is_dir():
            if self.ctx.resume_checkpoint is None:
                return None
            run_step, path = self.ctx.resume_checkpoint
            # the manifest's step counts optimizer steps (the names of the commits), the run dir's run steps
            step = next((s["step"] for s in reversed(states) if s["path"] == path), run_step)
            return {"path": path, "step": step, "run_step": run_step}
        checkpoints = [s for s in states if s["kind"] == "checkpoint"]
        return checkpoints[-1] if checkpoints else None

    async def _client_from(self, state: dict[str, Any]) -> Any:
        try:
            return await self.service.create_training_client_from_state_with_optimizer(state["path"])
        except Exception as e:
            if is_uncertain(e):
                raise
            raise TinkerResumeError(
                f"cannot resume: the Tinker service at {self.base_url} does not have the saved state "
                f"'{state['path']}' (step {state.get('run_step', state['step'])}) this run would continue from "
                f"(the service answered {service_answer(e)}). Saved states live on the "
                "service, not in the run directory: this one was deleted, expired, belongs to another account, or "
                "was saved on an emulator that has since restarted. No model was created on the service. Start over "
                "with --overwrite (or another --run-dir), or resume a run whose checkpoints the service still holds."
            ) from None

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # the original training may have been closed (a fork took its place): its family has them all
        trainings = self.training.family() if self.training is not None else []
        try:
            try:
                if exc_type is None:
                    # let the last calls (e.g. a sampler save) land in the manifest
                    drained = asyncio.gather(*(t.drain() for t in trainings))
                    await asyncio.wait_for(drained, self.config.request_timeout_s)
            finally:
                for training in trainings:
                    training.stop()
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
            "model": self.ctx.model,
            "lora_rank": self.config.lora_rank,
            "model_id": getattr(client, "model_id", None),
            "manifest": str(self.manifest.path) if self.manifest.path else None,
        }


def make_backend(config: TinkerConfig, ctx: BackendContext) -> TinkerBackend:
    """The backend for its ``[tinker]`` section and the run's context (``plugin.py`` registers it)."""
    return TinkerBackend(config, ctx)
