"""The cluster as one ``Backend``: the learner's processes for ``training``, the replicas' router
for ``sampling``, and the rollout workers behind ``distribute(dataset)``; the actor graph, the
schedulers and the metrics are those of a one-process run."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

from headrace.core import logs
from headrace.core.errors import ConfigError
from headrace.core.protocols import BackendContext, InnerBackend
from headrace.core.types import AdamParams, Datum, LossSpec, OptimResult, RLDataset, SamplerHandle
from headrace.plugins.registry import file_modules

from .config import RayConfig
from .learner import RayTraining, start_learner
from .replicas import ReplicaRouter, SamplerReplica
from .runtime import ensure_ray, import_ray
from .workers import DRIVEN, RemoteDataset, RolloutWorker, WorkerPool

log = logs.get_logger()
# training backends whose learner and sampler run in a process of ours (not a remote service's)
LOCAL_BACKENDS = ("sim", "torch")


def _submitted(coro: Any) -> asyncio.Future[Any]:
    """Started now; a failure nobody awaits (the run already stopping on the first) is not logged again."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


class ClusterTraining:
    """The learner's processes, with each publish carried to every sampler replica before it resolves."""

    def __init__(self, learner: RayTraining, router: ReplicaRouter):
        self.learner, self.router = learner, router

    def forward_backward(self, datums: list[Datum], loss: LossSpec) -> Any:
        return self.learner.forward_backward(datums, loss)

    def optim_step(self, adam: AdamParams) -> Any:
        inner = self.learner.optim_step(adam)

        async def with_publish_time() -> OptimResult:
            result: OptimResult = await inner
            if self.router.last_publish_s is not None:  # the last publish to every replica before this update
                result.metrics["time/publish"] = self.router.last_publish_s
            return result

        return _submitted(with_publish_time())

    def publish(self, version: int) -> Any:
        inner = self.learner.publish(version)  # submitted now, in order with the calls before it

        async def everywhere() -> SamplerHandle:
            handle: SamplerHandle = await inner
            await self.router.load_all(version, handle.ref)
            return SamplerHandle(version, ref=None)  # replicas sample by version

        return _submitted(everywhere())

    async def save_state(self, name: str) -> str:
        return await self.learner.save_state(name)

    async def load_state(self, path: str) -> None:
        await self.learner.load_state(path)

    async def delete_state(self, path: str) -> None:
        await self.learner.delete_state(path)

    def check_loss(self, loss: LossSpec) -> None:
        self.learner.check_loss(loss)


class RayClusterBackend:
    """``--cluster ray``'s ``Backend``: given its ``[ray]`` section, the run's context and the
    backends it places (the training one, and a sampler, or None), each built in the processes
    that run it."""

    def __init__(self, config: RayConfig, ctx: BackendContext, training: InnerBackend, sampler: InnerBackend | None):
        self.config, self.ctx = config, ctx
        self.inner_training, self.inner_sampler = training, sampler
        self.training: Any = None
        self.sampling: Any = None
        self.tokenizer: Any = None
        self._stack = contextlib.AsyncExitStack()
        self._actors: list[Any] = []
        self._started_ray = False
        self.pool: WorkerPool | None = None

    async def __aenter__(self) -> RayClusterBackend:
        try:
            await self._start()
        except BaseException as e:
            await self.__aexit__(type(e), e, None)
            raise
        return self

    async def _start(self) -> None:
        cfg = self.config
        ray = import_ray()
        # on the calling thread (the main one from the CLI): Ray sets its signal handlers there
        self._started_ray = ensure_ray(cfg.address, cfg.num_cpus)
        keep = self.ctx.lag + 3  # versions a request may still ask for, with room for a publish in flight
        # a replica samples only: no run directory of its own, nothing to restore
        local = dataclasses.replace(self.ctx, run_dir=None, resume_checkpoint=None)
        replica_cls = ray.remote(SamplerReplica).options(max_restarts=-1, max_concurrency=1000)
        inner = (self.inner_training, self.inner_sampler)
        replicas = [replica_cls.remote(*inner, local, i, keep) for i in range(cfg.sampler_replicas)]
        # a self-driven episode's one long call in a group of its own: answers never wait behind them
        at_once = cfg.episodes_per_worker
        worker_cls = ray.remote(max_restarts=-1, max_concurrency=at_once, concurrency_groups={DRIVEN: at_once})(
            RolloutWorker
        )
        workers = [worker_cls.remote(i) for i in range(cfg.rollout_workers)]
        self._actors = [*replicas, *workers]
        facts = await asyncio.gather(*(r.start.remote() for r in replicas))
        await asyncio.gather(*(w.ping.remote() for w in workers))
        self.tokenizer = facts[0]["tokenizer"]
        tasks = await self._stack.enter_async_context(asyncio.TaskGroup())
        router = ReplicaRouter(replicas, facts[0]["max_context"], keep)
        router.replicas.attach(tasks)
        self._stack.push_async_callback(router.replicas.stop)
        self.sampling = router
        learner = await start_learner(cfg, self.ctx, self.inner_training)
        self._stack.push_async_callback(learner.stop)
        self.training = ClusterTraining(learner, router)
        self.pool = WorkerPool(workers)
        self.pool.workers.attach(tasks)
        self._stack.push_async_callback(self.pool.workers.stop)
        # the replicas start from rank 0's own initial weights (the same by construction, and now by proof)
        await self.training.publish(0)
        log.info("cluster_started", **self.describe())

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self._stack.aclose()
        finally:
            ray = import_ray()
            for actor in self._actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            if self._started_ray:
                ray.shutdown()

    def initial_handle(self) -> SamplerHandle:
        return SamplerHandle(0, ref=None)

    def distribute(self, dataset: RLDataset) -> RLDataset:
        """The run's dataset with its envs made and stepped on the rollout workers."""
        assert self.pool is not None, "enter the backend first"
        from ray import cloudpickle

        for module in file_modules():  # the workers cannot import an env loaded from a file: sent by value
            cloudpickle.register_pickle_by_value(module)
        return RemoteDataset(dataset, self.pool)

    def describe(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "backend": self.inner_training.name,
            "cluster": "ray",
            "rollout_workers": cfg.rollout_workers,
            "sampler_replicas": cfg.sampler_replicas,
            "learner_processes": cfg.learner_processes,
        }


def make_backend(
    config: RayConfig, ctx: BackendContext, training: InnerBackend, sampler: InnerBackend | None
) -> RayClusterBackend:
    """The run's backend on Ray. On resume the learner loads the checkpoint the run restores
    (``training.load_state``), like any backend: nothing to do at construction."""
    if training.name not in LOCAL_BACKENDS:
        raise ConfigError(
            f"--cluster ray places the learner and the samplers in local processes, which the '{training.name}' "
            f"backend does not run in (it is a service already); use --cluster ray with "
            f"{' or '.join(LOCAL_BACKENDS)}, or run '{training.name}' in one process (--cluster none)."
        )
    if ctx.swap_in_flight:
        raise ConfigError(
            "the inflight scheduler swaps weights into generations that are running, which --cluster ray's "
            "sampler replicas do not do yet (a request is served by one version there). Use --scheduler async "
            "on the cluster (the same staleness bound, weights swapped between calls), or inflight in one "
            "process (--cluster none)."
        )
    import_ray()  # without Ray: the one clear error, before anything is built
    return RayClusterBackend(config, ctx, training, sampler)
