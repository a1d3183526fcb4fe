"""The Tinker learner: ordered, pipelined training calls with exactly-once recovery.

**One step, one cycle.** The service runs training in lock-step clock cycles: an op that
arrives after a cycle's boundary waits for the next one. The SDK sends one training client's
requests one at a time, each after the previous one's reply (a round trip each), so a step sent
as several ``forward_backward`` requests and an ``optim_step`` is a chain that a boundary can
cut, and the step then lands in two cycles. So a ``forward_backward`` is held until its step
closes: when the engine submits the ``optim_step`` (or anything else, or awaits the
``forward_backward``), the held calls go out as one request, with the ``optim_step`` right
behind it. A step is then two requests whatever its minibatches (three with the publish), sent
within one event-loop turn; each call's result still holds its own datums' logprobs.
``tinker.merge_forward_backward=false`` sends each call as it is made instead. A step that
applied no update (every group filtered) publishes the handle it already has: no weights are
saved, and the sampler keeps its client.

The rest is submitted to the SDK the moment the engine makes it (the next step's calls queue
behind the last ones before anything is awaited); one driver task awaits the results in
submission order and resolves the engine's futures.

**Exactly once.** A state is *committed* once a ``save_state`` after it has been confirmed
(the run's checkpoints, and the backend's own commits every ``tinker.commit_every`` steps).
The calls since the last commit stay in memory. When a training call's outcome is uncertain
(a timeout, a connection the SDK's retries could not restore, a server-side failure after
submission) the backend never re-submits it to the same training client: it abandons that
client, creates a new one from the last committed state *with its optimizer state*
(``create_training_client_from_state_with_optimizer``), re-runs every uncommitted call in
order, hands the engine the re-run's results, and records the recovery in the manifest. Each
gradient is therefore applied exactly once to the state the run continues from. Within one
client the SDK's own retries are safe: requests carry seq ids (and idempotency keys) that the
service deduplicates. A deterministic error (a bad request) fails the run instead.

**Non-finite results.** ``optim_step`` goes out right behind ``forward_backward``, before the
loss is known, and the gradient stays on the service: a NaN loss cannot be refused before it is
applied. So a non-finite loss (or optimizer metric) stops the run (``TinkerNonFiniteError``),
and the results are settled in order, so every call after the bad one fails with it: a save
after it is never recorded in the manifest or committed, and no recovery or ``--resume`` can
start from a state holding that step. Restarting from the last committed state leaves it out.

**Forks.** ``fork()`` makes a separate training state from this one's weights and Adam state: a
new client from a saved state (the last committed one when nothing has trained since, else a new
save), with its own driver and ops log, so the same exactly-once rule holds for it. Training it
never touches this one. ``close()`` lets a fork's calls finish and stops its driver. A fork's
save expires on the service after ``commit_ttl_s``, like a commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import Awaitable, Sequence
from typing import Any

from headrace.backends.tinker import convert
from headrace.backends.tinker.adapters import LocalAdapters, TinkerSamplerWeights
from headrace.backends.tinker.config import TinkerConfig
from headrace.backends.tinker.errors import TinkerNonFiniteError, TinkerRecoveryError, is_uncertain, service_answer
from headrace.backends.tinker.manifest import Manifest, resolve_state_path
from headrace.backends.tinker.requests import Held, HeldResult, Op, hand_back, merged, pass_on
from headrace.core.errors import BackendFailure
from headrace.core.types import AdamParams, Datum, ForwardBackwardResult, LossSpec, OptimResult, SamplerHandle


class TinkerTraining:
    # the graph asks before the first batch is sampled: a loss Tinker cannot compute is refused up front
    check_loss = staticmethod(convert.check_loss)

    def __init__(self, service: Any, config: TinkerConfig, manifest: Manifest):
        self._service, self._cfg, self._manifest = service, config, manifest
        self.client: Any = None  # the current tinker TrainingClient
        self._gen = 0
        self._log: list[Op] = []  # every op since the last commit, in submission order
        self._held: list[Held] = []  # forward_backwards waiting for their step to close
        self._published: Op | None = None  # the last publish, while no update has been submitted since
        self._queue: asyncio.Queue[Op] = asyncio.Queue()
        self._recovering = False
        self._failed: BaseException | None = None
        self._in_a_row = 0  # recoveries for the same call without getting past it
        self._last_failed: Op | None = None
        self._driver: asyncio.Task[None] | None = None
        self._tasks: asyncio.TaskGroup | None = None
        # this one and its forks, while started and not closed: the backend's task group waits for
        # every driver, so its exit must stop them all
        self._family: set[TinkerTraining] = set()
        self._forks = 0
        self._closed = False
        self.commit_path: str | None = None
        self.loaded_path: str | None = None
        self.steps_submitted = 0  # optim steps, counting from the state the run started at
        self.recoveries: list[dict[str, Any]] = []
        self.base_model = ""  # the model the run's LoRA starts from: what reference_logprobs scores with
        # set for a local sampler (--sampler vllm): each publish saves sampler weights it downloads
        self.adapters: LocalAdapters | None = None
        self._publishes = 0
        self._reference: Any = None  # a sampling client of it, made on first use

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, tasks: asyncio.TaskGroup, client: Any, committed: str | None, step: int = 0) -> None:
        """Start the driver in ``tasks``, the backend's task group: a driver bug fails the backend
        instead of leaving the engine awaiting futures nobody resolves."""
        self.client, self.commit_path, self.steps_submitted = client, committed, step
        self._tasks = tasks
        self._family.add(self)
        self._driver = tasks.create_task(self._drive(), name="tinker-training-driver")

    def stop(self) -> None:
        """Cancel the driver; the backend's task group awaits it."""
        if self._driver is not None:
            self._driver.cancel()

    async def drain(self) -> None:
        """Wait until every submitted call has resolved."""
        self._flush()
        for op in list(self._log):
            with contextlib.suppress(Exception):
                await asyncio.shield(op.out)

    def family(self) -> list[TinkerTraining]:
        """This training and its forks (and theirs) that are started and not closed."""
        return list(self._family)

    async def fork(self) -> TinkerTraining:
        """A separate training state from this one's weights and Adam state, as of every call
        submitted before; its driver runs in this one's task group."""
        assert self._tasks is not None, "start() the training before forking it"
        self._flush()
        self._check_usable()
        step = self.steps_submitted
        if self.commit_path is not None and not any(op.replay for op in self._log):
            path = self.commit_path  # the committed state is the current one: nothing to save
        else:
            self._forks += 1
            # not a checkpoint: a resume must not pick it, and it needs no sampler weights
            path = await self.commit(f"fork-{step:06d}-{self._forks}", kind="fork")
        try:
            client = await self._service.create_training_client_from_state_with_optimizer(path)
        except Exception as e:
            if is_uncertain(e):
                raise
            raise BackendFailure(
                f"cannot fork: the Tinker service refused to create a training client from the saved state "
                f"'{path}' (step {step}) it just confirmed (the service answered {service_answer(e)})."
            ) from None
        twin = TinkerTraining(self._service, self._cfg, self._manifest)
        twin._family = self._family
        twin.adapters = self.adapters
        twin.start(self._tasks, client, committed=path, step=step)
        twin.loaded_path = path
        return twin

    async def close(self) -> None:
        """Let every submitted call resolve, then stop the driver; later calls are refused."""
        if not self._closed:
            self._flush()
            self._closed = True
        if self._driver is not None and not self._driver.done():
            await self.drain()
        self.stop()
        self._family.discard(self)

    # -- the TrainingBackend protocol ------------------------------------------------------

    def forward_backward(self, datums: Sequence[Datum], loss: LossSpec) -> Awaitable[ForwardBackwardResult]:
        if not datums:
            raise ValueError("forward_backward needs at least one datum")
        self._check_usable()
        held = Held([convert.to_datum(d, loss) for d in datums], list(datums), loss.name, convert.loss_config(loss))
        self._held.append(held)
        if not self._cfg.merge_forward_backward:
            self._flush()
        return HeldResult(held.out, self._flush)

    def forward(self, datums: Sequence[Datum]) -> Awaitable[list[list[float]]]:
        """Each datum's target logprobs under the current weights: the service's ``forward``
        (no gradient; ``ComputesCustomLoss``). Not re-run on recovery: it changes no state."""
        data = [convert.to_datum(d, LossSpec("cross_entropy")) for d in datums]
        return self._submit(
            Op(
                "forward",
                lambda tc: tc.forward(data, "cross_entropy"),
                lambda out: convert.fb_result(out, list(datums)).logprobs_D,
                replay=False,
            )
        )

    def forward_backward_custom(self, datums: Sequence[Datum], loss_fn: Any) -> Awaitable[ForwardBackwardResult]:
        """The SDK's ``forward_backward_custom``: a ``forward``, ``loss_fn`` and its gradient by the
        logprobs on this machine, then a ``cross_entropy`` ``forward_backward`` whose weights are
        minus that gradient. Re-run on recovery like every gradient call."""
        data = [convert.to_datum(d, LossSpec("cross_entropy")) for d in datums]
        metrics: dict[str, float] = {}

        def custom(sdk_data: Any, logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
            total, extra = loss_fn(datums, logprobs)  # headrace's datums, not the SDK's
            metrics.update(extra)
            return total, extra

        def finish(out: Any) -> ForwardBackwardResult:
            result = convert.fb_result(out, list(datums))
            result.metrics |= metrics
            return result

        return self._submit(
            Op("forward_backward_custom", lambda tc: tc.forward_backward_custom(data, custom), finish, replay=True)
        )

    def reference_logprobs(self, datums: Sequence[Datum]) -> Awaitable[list[list[float]]]:
        """Each datum's target logprobs under the run's starting weights (``ScoresReference``): a
        LoRA model starts as its base, so a sampling client of the base model scores them
        (``compute_logprobs``), whatever state the run resumed from."""
        from tinker import types

        async def score() -> list[list[float]]:
            if self._reference is None:
                self._reference = await self._service.create_sampling_client(base_model=self.base_model)
            futures = [
                self._reference.compute_logprobs(types.ModelInput.from_ints([*d.model_input, d.target_tokens[-1]]))
                for d in datums
            ]
            rows = await asyncio.gather(*futures)
            return [[float(x) if x is not None else 0.0 for x in row[1:]] for row in rows]

        return asyncio.ensure_future(score())

    def _flush(self) -> None:
        """Send the held forward_backwards: each run of them with the same loss as one request."""
        while self._held:
            first = self._held[0]
            n = 1
            while n < len(self._held) and (self._held[n].loss, self._held[n].config) == (first.loss, first.config):
                n += 1
            held, self._held = self._held[:n], self._held[n:]
            self._submit(merged(held)).add_done_callback(functools.partial(hand_back, held))

    def optim_step(self, adam: AdamParams) -> Awaitable[OptimResult]:
        params = convert.adam(adam)
        self._flush()  # the step's forward_backwards, one request, right ahead of its optim_step
        self.steps_submitted += 1
        self._published = None
        out = self._submit(Op("optim_step", lambda tc: tc.optim_step(params), convert.optim_result, replay=True))
        every = self._cfg.commit_every
        if every and self.steps_submitted % every == 0:
            self.commit(f"commit-{self.steps_submitted:06d}", kind="commit")
        return out

    def publish(self, version: int) -> Awaitable[SamplerHandle]:
        self._flush()
        if self._published is not None:
            # no optim_step (and no load) since the last publish: the weights are the ones it saved
            self._check_usable()
            out: asyncio.Future[SamplerHandle] = asyncio.get_running_loop().create_future()
            self._published.out.add_done_callback(  # the saved weights, under the new version
                lambda published: pass_on(published, out, lambda h: SamplerHandle(version=version, ref=_at(h, version)))
            )
            return out
        if self.adapters is not None:
            # sampler weights with a path, which a local sampler downloads when it first samples them
            adapters, self._publishes = self.adapters, self._publishes + 1
            name, ttl = f"publish-{version:06d}-{self._publishes}", self._cfg.commit_ttl_s
            op = Op(
                "publish",
                lambda tc: tc.save_weights_for_sampler(name, ttl_seconds=ttl),
                lambda resp: SamplerHandle(version=version, ref=TinkerSamplerWeights(version, resp.path, adapters)),
                replay=False,
            )
            self._published = op
            return self._submit(op)
        op = Op(
            "publish",
            lambda tc: tc.save_weights_and_get_sampling_client(),
            lambda client: SamplerHandle(version=version, ref=client),
            replay=False,
        )
        self._published = op
        return self._submit(op)

    async def save_state(self, name: str) -> str:
        path = self.commit(name, kind="checkpoint")
        if self._cfg.save_sampler_weights:
            step = self.steps_submitted

            def record(resp: Any) -> str:
                self._manifest.add_sampler(name, resp.path, step)
                return resp.path

            self._submit(Op("save_sampler", lambda tc: tc.save_weights_for_sampler(name), record, replay=False))
        return await path

    async def load_state(self, path: str) -> None:
        """A ``tinker://`` state path, or a run directory / manifest (its latest state)."""
        self._flush()
        state, step = resolve_state_path(path)
        if step is None:
            step = next((s["step"] for s in self._manifest.data["states"] if s["path"] == state), None)
        if state == self.loaded_path and not any(op.replay for op in self._log):
            return  # already running from exactly this state, untrained since
        await self.drain()
        self.client = await self._service.create_training_client_from_state_with_optimizer(state)
        self._gen += 1
        self._log.clear()
        self._published = None
        self.commit_path = self.loaded_path = state
        if step is not None:
            self.steps_submitted = step

    def save_sampler_weights(self, name: str) -> asyncio.Future[str]:
        """The current weights as sampler weights with a path (``RUN_DIR/final`` downloads them)."""
        return self._submit(
            Op("save_sampler", lambda tc: tc.save_weights_for_sampler(name), lambda resp: resp.path, replay=False)
        )

    def commit(self, name: str, kind: str) -> asyncio.Future[str]:
        # automatic saves expire on the service: a commit is only a recovery base until the next
        # one, a fork's only its candidate's (a long serve would otherwise pile up one per candidate)
        step, ttl = self.steps_submitted, (self._cfg.commit_ttl_s if kind in ("commit", "fork") else None)

        def committed(resp: Any) -> str:
            self.commit_path = resp.path
            self._manifest.add_state(name, resp.path, step, kind)
            return resp.path

        return self._submit(Op(kind, lambda tc: tc.save_state(name, ttl_seconds=ttl), committed, replay=False))

    # -- submission and the driver ---------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise BackendFailure("this Tinker training was closed: it takes no more calls")
        if self._poisoned():
            raise TinkerNonFiniteError(str(self._failed))
        if self._failed is not None:
            raise TinkerRecoveryError(f"the tinker backend stopped after a failed recovery: {self._failed}")

    def _submit(self, op: Op) -> asyncio.Future[Any]:
        if op.kind != "forward_backward":
            self._flush()  # calls go out in the order the engine made them
        self._check_usable()
        op.step = self.steps_submitted
        self._log.append(op)
        if not self._recovering:
            self._send(op)
        self._queue.put_nowait(op)
        return op.out

    def _send(self, op: Op) -> None:
        op.gen = self._gen
        try:
            op.sdk = op.send(self.client)
        except Exception as e:  # noqa: BLE001 - surfaces when the driver awaits this call
            op.sdk = asyncio.get_running_loop().create_future()
            op.sdk.set_exception(e)

    async def _await(self, op: Op) -> Any:
        async def result() -> Any:
            return await op.sdk

        return await asyncio.wait_for(result(), self._cfg.request_timeout_s)

    async def _drive(self) -> None:
        while True:
            op = await self._queue.get()
            try:
                await self._settle(op)
            except TinkerRecoveryError as e:
                self._fail_all(e)
            except Exception as e:  # noqa: BLE001 - never leave the engine awaiting a dead driver
                self._fail_all(TinkerRecoveryError(f"the tinker training driver failed: {type(e).__name__}: {e}"))
            self._trim(op)

    def _trim(self, settled: Op) -> None:
        """Forget what a recovery can no longer need: everything up to a confirmed commit, and
        (with nothing committed to replay onto) every resolved call."""
        out = settled.out
        ok = out.done() and not out.cancelled() and out.exception() is None
        if ok and settled.kind in ("commit", "checkpoint", "fork") and settled in self._log:
            del self._log[: self._log.index(settled) + 1]
        elif self.commit_path is None:
            while self._log and self._log[0].out.done():
                self._log.pop(0)

    async def _settle(self, op: Op) -> None:
        while True:
            if self._poisoned():
                return
            try:
                result = await self._await(op)
            except Exception as e:  # noqa: BLE001 - sorted into uncertain and deterministic below
                if not is_uncertain(e):
                    if not op.out.done():
                        op.out.set_exception(e)
                    return
                await self._recover(op, e)
                continue
            self._in_a_row = 0
            if self._poisoned():
                return
            try:
                value = op.finish(result)
            except Exception as e:  # noqa: BLE001 - a malformed result is the call's error
                if not op.out.done():
                    op.out.set_exception(e)
                return
            bad = {k: v for k, v in (getattr(value, "metrics", None) or {}).items() if not math.isfinite(v)}
            if bad:
                error = self._non_finite(op, bad)
                self._fail_all(error)
                if not op.out.done():
                    op.out.set_exception(error)
                return
            if not op.out.done():
                op.out.set_result(value)
            return

    def _poisoned(self) -> bool:
        """A result before this call was non-finite: it already failed, and its outcome (a save
        holding the bad step) must never be finished, i.e. recorded or committed."""
        return isinstance(self._failed, TinkerNonFiniteError)

    def _non_finite(self, op: Op, bad: dict[str, float]) -> TinkerNonFiniteError:
        values = ", ".join(f"{k}={v}" for k, v in bad.items())
        step = op.step + (op.kind != "optim_step")  # a forward_backward counts the steps before its own
        return TinkerNonFiniteError(
            f"the Tinker service returned a non-finite result for {op.kind} (optimizer step {step} of this model: "
            f"{values}). Its optim_step had already been sent (it goes out right behind forward_backward, before the "
            "loss is known), so the model on the service may hold a bad update: the run stops here, and no state from "
            "this step on is committed or recorded as a checkpoint (the last committed state: "
            f"{self.commit_path or 'none'}). A resumed run restarts from the run's last checkpoint, which precedes "
            "this step. Look for NaN or extreme rewards, advantages or logprobs in this step's data, or lower "
            "optim.learning_rate."
        )

    # -- recovery --------------------------------------------------------------------------

    async def _recover(self, failed: Op, error: BaseException) -> None:
        while True:
            self._in_a_row = self._in_a_row + 1 if failed is self._last_failed else 1
            self._last_failed = failed
            record = {
                "op": failed.kind,
                "error": f"{type(error).__name__}: {error}",
                "from_state": self.commit_path,
                "abandoned_model": getattr(self.client, "model_id", None),
                "at_step": failed.step,
            }
            if self.commit_path is None:
                raise TinkerRecoveryError(
                    f"a {failed.kind} call's outcome is uncertain ({record['error']}) and no "
                    "state is committed to recover from; set tinker.commit_every > 0"
                )
            if self._in_a_row > self._cfg.max_recoveries:
                raise TinkerRecoveryError(
                    f"gave up after {self._cfg.max_recoveries} recoveries in a row; last: {record['error']}"
                )
            started = time.perf_counter()
            try:
                replayed = await self._restart()
            except Exception as e:  # noqa: BLE001 - sorted below
                if not is_uncertain(e):
                    raise TinkerRecoveryError(f"recovery failed: {type(e).__name__}: {e}") from e
                error = e
                continue
            record.update(
                new_model=getattr(self.client, "model_id", None),
                replayed_resolved=replayed,
                rerun=sum(op.gen == self._gen for op in self._log),
                recovery_s=round(time.perf_counter() - started, 3),
            )
            self.recoveries.append(record)
            self._manifest.add_recovery(record)
            return

    async def _restart(self) -> int:
        """A new client from the committed state; every uncommitted call re-sent, in order."""
        self._recovering = True
        try:
            for op in self._log:
                if op.sdk is not None and hasattr(op.sdk, "future") and not op.out.done():
                    with contextlib.suppress(Exception):
                        op.sdk.future().cancel()
            self.client = await self._service.create_training_client_from_state_with_optimizer(self.commit_path)
            self._gen += 1
            self._resend()
            replayed = [op for op in self._log if op.out.done() and op.gen == self._gen]
            for op in replayed:  # calls that had resolved: re-run, and check they went through
                await self._await(op)
            self._resend()  # calls the engine made meanwhile
            return len(replayed)
        finally:
            self._recovering = False

    def _resend(self) -> None:
        for op in self._log:
            if op.gen != self._gen and (op.replay or not op.out.done()):
                self._send(op)

    def _fail_all(self, error: BaseException) -> None:
        self._failed = error
        held, self._held = self._held, []
        outs: list[asyncio.Future[Any]] = [op.out for op in self._log] + [h.out for h in held]
        for out in outs:
            if not out.done():
                out.set_exception(error)


def _at(handle: SamplerHandle, version: int) -> Any:
    """A handle's weights, published again as ``version`` (a local adapter is kept by version)."""
    ref = handle.ref
    return ref.at(version) if isinstance(ref, TinkerSamplerWeights) else ref
