"""The learner as K data-parallel processes (``ray.learner_processes``), each a Ray actor.

Every rank holds the whole model (built by the run's own backend, from the same seed, so the
ranks start equal) and gets a contiguous shard of each ``forward_backward`` call, balanced by
loss tokens. At ``optim_step`` the trainer's ``gradient_sum`` hook all-reduces the summed
gradients and the step's loss-token count and divisor over gloo, so every rank divides the same
total by the same divisor and takes the same step: the update is the one-process update, up to
the order of float additions (``data_parallel.py``). Rank 0 alone publishes and saves.

``ray`` is imported lazily (``import_ray``): importing this module needs neither Ray nor torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from headrace.core.advantages import NonFiniteError
from headrace.core.errors import BackendFailure, ConfigError
from headrace.core.protocols import (
    BackendContext,
    ChecksLoss,
    DeletesState,
    InnerBackend,
    SumsGradients,
    TransientBackendError,
)
from headrace.core.types import AdamParams, Datum, ForwardBackwardResult, LossSpec, OptimResult, SamplerHandle
from headrace.net.addresses import is_loopback
from headrace.plugins.backends import build_inner

from .data_parallel import gradient_sum, loss_divisor, merge_metrics, shard_bounds
from .runtime import import_ray

if TYPE_CHECKING:
    from .config import RayConfig

# a collective waits this long for a peer before failing (a rank stuck, not dead: a dead one
# closes its sockets and its peers fail at once)
GROUP_TIMEOUT_S = 600.0
# after one rank's call fails, how long to wait for the others: a dead rank makes its peers'
# all-reduce fail too, and the death is what the message must name
DEATH_GRACE_S = 5.0
STOP_TIMEOUT_S = 30.0
# errors the engine acts on by type, or whose message is meant for the user: re-raised as they
# were raised in the rank, not wrapped in Ray's remote traceback
PASS_THROUGH = (ConfigError, BackendFailure, NonFiniteError, TransientBackendError)


class LearnerRankLost(BackendFailure):
    """A learner process died: its gradients and optimizer state are gone, so the run stops."""


class LearnerRank:
    """One learner process (``ray.remote(LearnerRank)``). Calls carry a sequence number from the
    driver and are submitted to the backend in that order: Ray does not promise an async actor
    starts its calls in submission order, and the trainer must see them so."""

    def __init__(self, training: InnerBackend, ctx: BackendContext, rank: int, world: int):
        self.rank, self.world = rank, world
        self.master = ""  # host:port of rank 0's rendezvous, on rank 0's node
        # the training backend alone: the replicas sample, and a rank with its own sampler (a vLLM
        # engine) would only hold memory; several ranks sum their gradients before each update
        self.inner = training
        self.ctx = dataclasses.replace(ctx, resume_checkpoint=None, gradient_sum=gradient_sum if world > 1 else None)
        self._stack = contextlib.AsyncExitStack()
        self._next = 0  # the sequence number of the next call to submit
        self._waiting: dict[int, asyncio.Future[None]] = {}
        self.backend: Any = None
        self.training: Any = None

    def rendezvous(self) -> str:
        """Rank 0: an address on its own node the others can reach (so ranks may sit on other nodes)."""
        import ray

        host = ray.util.get_node_ip_address()
        return f"{host}:{free_port(host)}"

    async def start(self, master: str = "") -> dict[str, Any]:
        self.master = master
        self.backend = build_inner(self.inner, self.ctx)
        self.training = self.backend.training
        if self.world > 1 and not isinstance(self.training, SumsGradients):
            raise ConfigError(
                f"ray.learner_processes={self.world} splits each batch over processes whose gradients are "
                f"summed, and the '{self.inner.name}' backend computes none to sum; set ray.learner_processes=1."
            )
        await self._stack.enter_async_context(self.backend)
        if self.world > 1:
            await asyncio.to_thread(self._join_group)
        return {**self.backend.describe(), "rank": self.rank, "learner_processes": self.world}

    def _join_group(self) -> None:
        import torch.distributed as dist

        host = self.master.rpartition(":")[0]
        if sys.platform == "linux" and is_loopback(host):
            # a one-machine instance on loopback: gloo must not pick the hostname's interface
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{self.master}",
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=GROUP_TIMEOUT_S),
        )

    # ---- calls, in the driver's order ----

    async def _ordered(self, seq: int, call: Callable[[], Awaitable[Any]], hold: bool = False) -> Any:
        """Submit ``call()`` once every call numbered before ``seq`` is submitted. ``hold``: a
        coroutine (it submits only when it runs), so the next call waits for it to finish."""
        if self._next != seq:
            waiter = asyncio.get_running_loop().create_future()
            self._waiting[seq] = waiter
            await waiter
        try:
            pending = call()
            if hold:
                return await pending
        finally:
            self._next += 1
            woken = self._waiting.pop(self._next, None)
            if woken is not None and not woken.done():
                woken.set_result(None)
        return await pending

    async def forward_backward(self, seq: int, datums: list[Datum], loss: LossSpec) -> ForwardBackwardResult:
        return await self._ordered(seq, lambda: self.training.forward_backward(datums, loss))

    async def optim_step(self, seq: int, adam: AdamParams) -> OptimResult:
        return await self._ordered(seq, lambda: self.training.optim_step(adam))

    async def publish(self, seq: int, version: int) -> tuple[Any, None]:
        """The weights (to the object store, as the first of two returns) and a small second
        return the driver awaits without fetching them."""
        handle = await self._ordered(seq, lambda: self.training.publish(version))
        return self.backend.weights_of(handle), None

    async def save_state(self, seq: int, name: str) -> str:
        return await self._ordered(seq, lambda: self.training.save_state(name), hold=True)

    async def load_state(self, seq: int, path: str) -> None:
        await self._ordered(seq, lambda: self.training.load_state(path), hold=True)

    async def delete_state(self, seq: int, path: str) -> None:
        training = self.training
        delete = (lambda: training.delete_state(path)) if isinstance(training, DeletesState) else _nothing
        await self._ordered(seq, delete, hold=True)

    async def check_loss(self, loss: LossSpec) -> str | None:
        """The inner backend's refusal of ``loss`` (its message), None if it takes it."""
        try:
            if isinstance(self.training, ChecksLoss):
                self.training.check_loss(loss)
        except ConfigError as e:
            return str(e)
        return None

    async def stop(self) -> None:
        await self._stack.aclose()
        if self.world > 1:  # only then was a process group made (and torch is there)
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()


async def _nothing() -> None:
    return None


class RayTraining:
    """The driver's ``TrainingBackend`` over the K ranks. Every call is sent when it is made, so
    the returned awaitables are already submitted, in order."""

    def __init__(self, ranks: list[Any]):
        self.ranks = ranks
        self.world = len(ranks)
        self.facts: dict[str, Any] = {}  # rank 0's describe()
        self._seq = [0] * self.world

    def _send(self, rank: int, method: str, *args: Any, num_returns: int = 1) -> Any:
        remote = getattr(self.ranks[rank], method)
        if num_returns != 1:
            remote = remote.options(num_returns=num_returns)
        ref = remote.remote(self._seq[rank], *args)
        self._seq[rank] += 1  # only once sent: a number the rank never gets would stall every later call
        return ref

    def forward_backward(self, datums: Sequence[Datum], loss: LossSpec) -> asyncio.Future[ForwardBackwardResult]:
        datums = list(datums)
        bounds = shard_bounds(datums, self.world)
        spans = list(itertools.pairwise(bounds))
        refs = [self._send(i, "forward_backward", datums[a:b], loss) for i, (a, b) in enumerate(spans)]

        async def merged() -> ForwardBackwardResult:
            results = await self._gather(list(enumerate(refs)))
            if self.world == 1:
                return results[0]
            divisors = [loss_divisor(datums[a:b], loss) for a, b in spans]
            return ForwardBackwardResult(
                logprobs_D=[lps for r in results for lps in r.logprobs_D],  # contiguous shards: the datums' order
                metrics=merge_metrics([r.metrics for r in results], divisors),
            )

        return asyncio.ensure_future(merged())

    def optim_step(self, adam: AdamParams) -> asyncio.Future[OptimResult]:
        refs = [self._send(i, "optim_step", adam) for i in range(self.world)]

        async def first() -> OptimResult:
            results = await self._gather(list(enumerate(refs)))
            return results[0]  # every rank took the same step

        return asyncio.ensure_future(first())

    def publish(self, version: int) -> asyncio.Future[SamplerHandle]:
        """A handle whose ``ref`` is the ObjectRef of rank 0's weights (``weights_of``): stored
        once, owned by this process, read by each replica from the shared-memory object store."""
        weights, done = self._send(0, "publish", version, num_returns=2)

        async def handle() -> SamplerHandle:
            await self._gather([(0, done)])
            return SamplerHandle(version, ref=weights)

        return asyncio.ensure_future(handle())

    async def save_state(self, name: str) -> str:
        path: str = (await self._gather([(0, self._send(0, "save_state", name))]))[0]
        return path

    async def load_state(self, path: str) -> None:
        await self._gather([(i, self._send(i, "load_state", path)) for i in range(self.world)])

    async def delete_state(self, path: str) -> None:
        await self._gather([(0, self._send(0, "delete_state", path))])

    def check_loss(self, loss: LossSpec) -> None:
        """Refuse, before the run starts, a loss the backend cannot compute (its own ConfigError)."""
        ray = import_ray()
        refusal = ray.get(self.ranks[0].check_loss.remote(loss))
        if refusal is not None:
            raise ConfigError(refusal)

    def describe(self) -> dict[str, Any]:
        return dict(self.facts)

    async def stop(self) -> None:
        ray = import_ray()
        stops = [asyncio.ensure_future(_awaited(rank.stop.remote())) for rank in self.ranks]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*stops, return_exceptions=True), STOP_TIMEOUT_S)
        for rank in self.ranks:
            with contextlib.suppress(Exception):
                ray.kill(rank)

    async def _gather(self, calls: list[tuple[int, Any]]) -> list[Any]:
        tasks = [asyncio.ensure_future(self._result(rank, ref)) for rank, ref in calls]
        for task in tasks:  # a sibling's failure is reported once, not again when it is collected
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            return list(await asyncio.gather(*tasks))
        except Exception:
            await asyncio.wait(tasks, timeout=DEATH_GRACE_S)
            for task in tasks:
                error = task.exception() if task.done() and not task.cancelled() else None
                if isinstance(error, LearnerRankLost):
                    raise error from None
            raise

    async def _result(self, rank: int, ref: Any) -> Any:
        ray = import_ray()
        try:
            return await ref
        except ray.exceptions.RayActorError as e:
            raise LearnerRankLost(
                f"learner process {rank} of {self.world} died ({type(e).__name__}); its gradients and optimizer "
                "state are gone, so the run stops here. Run again with --resume to continue from the last checkpoint."
            ) from e
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, PASS_THROUGH):
                raise e.cause from None
            raise


async def _awaited(ref: Any) -> Any:
    return await ref


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _gpus_per_rank(training: InnerBackend, world: int, ray: Any) -> float:
    """A rank on a GPU must ask Ray for one (Ray hides the GPUs from an actor that did not)."""
    device = str(training.section.get("device", "cpu"))
    gpus = float(ray.cluster_resources().get("GPU", 0))
    if device == "cpu" or gpus == 0:
        return 0.0
    return min(1.0, gpus / world)


async def start_learner(config: RayConfig, ctx: BackendContext, inner: InnerBackend) -> RayTraining:
    """``ray.learner_processes`` ranks, started (each builds the training backend ``inner``) and
    joined in one gloo group; Ray must be running (``runtime.ensure_ray``). A rank is never
    restarted: its state cannot be rebuilt from the others mid-step."""
    ray = import_ray()
    if not ray.is_initialized():
        raise RuntimeError("start_learner needs Ray running first (headrace.backends.ray.runtime.ensure_ray)")
    world = config.learner_processes
    actor = ray.remote(LearnerRank).options(max_restarts=0, num_gpus=_gpus_per_rank(inner, world, ray))
    training = RayTraining([actor.remote(inner, ctx, rank, world) for rank in range(world)])
    try:
        master = await training.ranks[0].rendezvous.remote() if world > 1 else ""
        facts = await training._gather([(i, rank.start.remote(master)) for i, rank in enumerate(training.ranks)])
    except BaseException:
        await training.stop()
        raise
    training.facts = facts[0]
    return training
