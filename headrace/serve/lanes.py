"""The versions behind ``headrace serve``: each *lane* (the service's own chain, and with
``serve.per_scenario`` one per scenario), its incumbent, the candidates trained on its scored
completions, their gate, and rollback. ``service.py`` serves requests on top of it.

One version serves a lane at a time (the *incumbent*). When ``serve.batch_size`` scored
completions of it are in, a *candidate* is forked from it (weights and Adam state, a separate
training state: the incumbent is never touched), trained one optimizer step, gated, and then
published (saved, written to the version chain, and only then switched to) or rejected (dropped).

With ``serve.per_scenario``, each scenario (the ``x-headrace-scenario`` header or
``metadata.scenario``) is a lane of its own: its own chain (``D/scenarios/<s>/versions.jsonl``),
incumbent, candidates, gate and rollback, all forked from the one base model the service loaded
(with a LoRA model, one adapter per scenario on it; on vLLM, each its own adapter on one engine).
A request without a scenario is served by the service's own chain (``D/versions.jsonl``), as when
the mode is off. A scenario's lane starts, at its first request, from version 0 (the weights the
service started from).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from headrace.core import logs
from headrace.core.errors import ConfigError
from headrace.core.protocols import Backend, Forks, HasLearnerSampler, ReportsHandoffs
from headrace.core.sampler import SamplerActor
from headrace.core.types import AdamParams, SamplerHandle
from headrace.net.openai_wire import ApiError
from headrace.run.config import RunConfig

from .candidates import Batch, make_batch
from .chain import SCENARIO_NAME, VersionChain
from .config import serve_options
from .gate import EnvGate
from .store import Completion, Store

log = logs.get_logger()


@dataclasses.dataclass(frozen=True)
class Serving:
    """The incumbent: its version, the chain line that made it so, its weights and training state."""

    version: int
    epoch: int
    handle: SamplerHandle
    training: Any


def check_per_scenario(config: RunConfig) -> None:
    """Per scenario, each incumbent is its own weights: on vLLM, one LoRA adapter per scenario on one
    base model (multi-LoRA), which the torch learner's LoRA versions are."""
    if not serve_options(config).per_scenario or config.sampler is None:
        return
    lora = config.backend == "torch" and bool(config.section("torch").lora_rank)
    if config.sampler != "vllm" or not lora:
        raise ConfigError(
            f"serve.per_scenario serves one set of weights per scenario at once; the '{config.sampler}' sampler "
            f"over the '{config.backend}' backend{' with full fine-tuning' if config.backend == 'torch' else ''} "
            "holds one version at a time. Serve per scenario with --backend torch --sampler vllm and a LoRA model (a "
            "pretrained one, or --set torch.lora_rank=16): each scenario's incumbent is then an adapter of its "
            "own on one vLLM engine; or without --sampler (the torch or tinker backend samples for itself)."
        )


class Lane:
    """One chain of versions and what trains on it: the service's own (``name`` None) or a
    scenario's (``serve.per_scenario``)."""

    def __init__(self, name: str | None, chain: VersionChain):
        self.name, self.chain = name, chain
        self.serving: Serving | None = None
        self.switch = asyncio.Lock()  # publish and rollback change the incumbent one at a time
        # scored completions no candidate has taken yet: what a batch is drawn from, kept apart so
        # a feedback does not rescan every completion ever served
        self.pending: dict[str, Completion] = {}

    def checkpoint_name(self, version: int) -> str:
        return f"v{version:06d}" if self.name is None else f"s.{self.name}.v{version:06d}"

    def shown(self, version: int) -> str:
        return f"version {version}" if self.name is None else f"scenario '{self.name}' version {version}"


class Lanes:
    """The lanes of a service and what changes their incumbents: candidates and rollback."""

    def __init__(self, config: RunConfig, backend: Backend, run_dir: Path, say: Callable[[str], None] = print):
        """``say``: one line for the operator each time the incumbent changes (or a candidate fails)."""
        self.config, self.backend, self.run_dir, self.say = config, backend, run_dir, say
        self.options = options = serve_options(config)
        self.per_scenario = options.per_scenario
        check_per_scenario(config)
        self.lanes: dict[str | None, Lane] = {None: Lane(None, VersionChain(run_dir))}
        if self.per_scenario:
            for path in sorted((run_dir / "scenarios").glob("*/versions.jsonl")):
                if SCENARIO_NAME.fullmatch(path.parent.name):
                    self.lanes[path.parent.name] = Lane(path.parent.name, VersionChain(path.parent))
        for lane in self.lanes.values():
            lane.chain.open()
        self.store = Store(run_dir)
        self.sampler = SamplerActor(backend.sampling, backend.initial_handle())
        self.loss = config.loss.spec(config.sampling.max_tokens)
        self.adam = AdamParams(**config.optim.model_dump())
        # a candidate is judged on the learner's own sampler (HasLearnerSampler): rejected, it was
        # never handed to a separate one (vLLM), whose adapters are the versions that serve
        learner = backend.learner_sampling if isinstance(backend, HasLearnerSampler) else None
        judge = SamplerActor(learner, backend.initial_handle()) if learner is not None else self.sampler
        self.gate = EnvGate(config, backend, judge) if options.gate == "env" else None
        self._scored = asyncio.Event()
        self._new_lane = asyncio.Lock()
        used = {cid for lane in self.lanes.values() for cid in lane.chain.used_completions()}
        for c in self.store.completions.values():
            if c.reward is not None and c.id not in used and self.lane_key(c.scenario) in self.lanes:
                self.lanes[self.lane_key(c.scenario)].pending[c.id] = c

    @property
    def chain(self) -> VersionChain:
        """The service's own chain (``D/versions.jsonl``)."""
        return self.lanes[None].chain

    @property
    def serving(self) -> Serving | None:
        """The incumbent of the service's own chain."""
        return self.lanes[None].serving

    def handoff(self, version: int, scope: str | None) -> dict[str, Any] | None:
        """How ``version`` of the chain ``scope`` names reached the sampler (``ReportsHandoffs``)."""
        return self.backend.handoff(version, scope) if isinstance(self.backend, ReportsHandoffs) else None

    def lane_key(self, scenario: str | None) -> str | None:
        return scenario if self.per_scenario else None

    # -- starting --------------------------------------------------------------------------

    async def start(self) -> Serving:
        """Serve the chain's incumbent (``--resume``), or version 0, saved first so it can be
        rolled back to."""
        if not isinstance(self.backend.training, Forks):
            raise ConfigError(
                f"the '{self.config.backend}' backend cannot fork a training state, which every candidate "
                "starts as; serve with --backend torch or --backend tinker."
            )
        training = self.backend.training
        own = self.lanes[None]
        current = own.chain.incumbent()
        if current is None:
            checkpoint = await training.save_state("v000000")
            entry = own.chain.append("initial", 0, parent=None, checkpoint=checkpoint)
            handle = self.backend.initial_handle()
            own.serving = _serving(0, entry["line"], handle, training)
        else:
            await training.load_state(current.checkpoint)
            handle = await training.publish(current.version)
            own.serving = _serving(current.version, current.epoch, handle, training)
        for lane in self.lanes.values():
            if lane.name is not None:  # a scenario's lane, from before a restart
                incumbent = lane.chain.incumbent()
                if incumbent is None:  # killed before its first line was written
                    await self._begin(lane)
                else:
                    lane.serving = await self._load(incumbent.version, incumbent.epoch, incumbent.checkpoint, lane.name)
        self._scored.set()  # scored completions left from before a restart may already fill a batch
        return own.serving

    async def _load(self, version: int, epoch: int, checkpoint: str, scope: str | None) -> Serving:
        """A training state of its own holding ``checkpoint``, forked from the service's."""
        base = self.lanes[None].serving
        assert base is not None
        training = await base.training.fork()
        await training.load_state(checkpoint)
        return _serving(version, epoch, await _scoped(training.publish(version), scope), training)

    async def lane(self, scenario: str | None) -> Lane:
        """The lane that serves ``scenario``; a scenario's first request starts its lane at version 0."""
        key = self.lane_key(scenario)
        if key in self.lanes:
            return self.lanes[key]
        assert key is not None
        if not SCENARIO_NAME.fullmatch(key):
            raise ApiError(
                400, f"scenario {key!r} cannot name a chain of versions: with serve.per_scenario a scenario is 1 to "
                "64 letters, digits, '_' or '-'", "metadata.scenario",
            )  # fmt: skip
        async with self._new_lane:
            if key not in self.lanes:
                (self.run_dir / "scenarios" / key).mkdir(parents=True, exist_ok=True)
                lane = Lane(key, VersionChain(self.run_dir / "scenarios" / key))
                lane.chain.open()
                await self._begin(lane)
                self.lanes[key] = lane
                self.say(f"headrace serve: scenario '{key}' has its own chain now, from version 0")
        return self.lanes[key]

    async def _begin(self, lane: Lane) -> None:
        """A scenario's version 0: the weights the service started from (the own chain's first line)."""
        initial = self.lanes[None].chain.entries[0]["checkpoint"]
        lane.serving = await self._load(0, 0, initial, lane.name)
        lane.chain.append("initial", 0, parent=None, checkpoint=initial, scenario=lane.name)

    def close(self) -> None:
        self.store.close()
        for lane in self.lanes.values():
            lane.chain.close()

    # -- candidates ------------------------------------------------------------------------

    def trainable(self, lane: Lane | None = None) -> list[Completion]:
        """A lane's scored, untrained completions no more than ``serve.max_staleness`` publishes old,
        oldest first. One older than that never trains (staleness only grows): it leaves the pool."""
        lane = lane or self.lanes[None]
        limit = self.options.max_staleness
        for c in [c for c in lane.pending.values() if lane.chain.epochs_since(c.epoch) > limit]:
            lane.pending.pop(c.id, None)
        return sorted(lane.pending.values(), key=lambda c: c.created)

    async def train_candidates(self) -> None:
        """Runs for the service's life: one candidate whenever a lane's batch is ready."""
        size = self.options.batch_size
        while True:
            await self._scored.wait()
            self._scored.clear()
            for lane in list(self.lanes.values()):
                while len(pool := self.trainable(lane)) >= size:
                    await self.candidate(pool[:size], lane)

    async def candidate(self, completions: list[Completion], lane: Lane | None = None) -> dict[str, Any]:
        lane = lane or self.lanes[None]
        parent = lane.serving
        assert parent is not None
        version = lane.chain.next_version()
        used: dict[str, Any] = {"parent": parent.version, "completions": [c.id for c in completions]}
        try:
            batch = make_batch(
                completions, lane.chain.baselines(), self.options.baseline_decay,
                self.config.advantages.normalize_std,
            )  # fmt: skip
        except ValueError as e:  # rewards no advantage can be trained on: this candidate fails, the service goes on
            return self._failed(lane, version, used, e, completions)
        used |= {"baselines": batch.baselines, "metrics": batch.metrics}
        started = anyio.current_time()
        candidate = await parent.training.fork()
        retired = candidate  # the training state let go of at the end: the candidate, or the old incumbent
        try:
            handle, metrics = await self._train(candidate, batch, version, lane.name)
            gate = await self._judge(handle, parent, lane)
            used["metrics"] = {**batch.metrics, **metrics, "time/candidate": anyio.current_time() - started}
            async with lane.switch:
                if lane.serving is not parent:  # rolled back while it trained
                    entry = lane.chain.append("discarded", version, reason="the incumbent changed", gate=gate, **used)
                elif gate["passed"]:
                    checkpoint = await candidate.save_state(lane.checkpoint_name(version))
                    entry = lane.chain.append("published", version, checkpoint=checkpoint, gate=gate, **used)
                    lane.serving = _serving(version, entry["line"], handle, candidate)
                    retired = parent.training
                else:
                    entry = lane.chain.append("rejected", version, gate=gate, **used)
        except Exception as e:
            return self._failed(lane, version, used, e, completions)
        finally:
            with anyio.CancelScope(shield=True):
                await retired.close()
        return self._done(lane, entry, completions)

    def _failed(
        self, lane: Lane, version: int, used: dict[str, Any], error: Exception, completions: list[Completion]
    ) -> dict[str, Any]:
        """The service goes on serving the incumbent; the batch is not tried again."""
        entry = lane.chain.append("failed", version, error=f"{type(error).__name__}: {error}", **used)
        log.error(
            "serve_candidate_failed", version=version, scenario=lane.name, error=f"{type(error).__name__}: {error}"
        )
        return self._done(lane, entry, completions)

    def _done(self, lane: Lane, entry: dict[str, Any], completions: list[Completion]) -> dict[str, Any]:
        for c in completions:  # in the chain's line now, whatever the outcome: never batched again
            lane.pending.pop(c.id, None)
        log.info(
            "serve_candidate", scenario=lane.name,
            **{k: v for k, v in entry.items() if k not in ("completions", "baselines")},
        )  # fmt: skip
        self.say(_candidate_line(entry, len(completions), lane))
        return entry

    async def _train(
        self, candidate: Any, batch: Batch, version: int, scope: str | None
    ) -> tuple[SamplerHandle, dict[str, float]]:
        fb = candidate.forward_backward(batch.datums, self.loss)
        step = candidate.optim_step(self.adam)
        published = _scoped(candidate.publish(version), scope)  # asked for now: queued behind the step
        fb_result, step_result, handle = await fb, await step, await published
        return handle, {**fb_result.metrics, **step_result.metrics}

    async def _judge(self, handle: SamplerHandle, parent: Serving, lane: Lane) -> dict[str, Any]:
        if self.gate is None:
            return {"gate": "always", "passed": True}
        return await self.gate.judge(handle, parent.handle, lane.name)

    # -- rollback --------------------------------------------------------------------------

    async def rollback(self, version: Any, scenario: Any = None) -> dict[str, Any]:
        if isinstance(version, bool) or not isinstance(version, int):
            raise ApiError(400, f"'version' must be an integer (a published version), got {version!r}", "version")
        if scenario is not None and not isinstance(scenario, str):
            raise ApiError(400, f"'scenario' must be a string, got {scenario!r}", "scenario")
        lane = self.lanes.get(self.lane_key(scenario))
        if lane is None:
            raise ApiError(404, f"no scenario '{scenario}' has been served here, so it has no versions", "scenario")
        async with lane.switch:
            checkpoint = lane.chain.checkpoint_of(version)
            if checkpoint is None:
                raise ApiError(404, lane.chain.cannot_roll_back(version), "version")
            parent = lane.serving
            assert parent is not None
            training = await parent.training.fork()
            await training.load_state(checkpoint)
            handle = await _scoped(training.publish(version), lane.name)
            entry = lane.chain.append("rollback", version, checkpoint=checkpoint, parent=parent.version)
            lane.serving = _serving(version, entry["line"], handle, training)
        with anyio.CancelScope(shield=True):
            await parent.training.close()
        log.info("serve_rollback", version=version, parent=parent.version, scenario=lane.name)
        self.say(f"headrace serve: rolled back to {lane.shown(version)} (was version {parent.version}); serving it now")
        self._scored.set()
        return entry


def _serving(version: int, epoch: int, handle: SamplerHandle, training: Any) -> Serving:
    """The incumbent, its handle ordered by the chain line that made it so: a version rolled back
    to is newer than the one it replaced (vLLM keeps its adapter, and releases the other's)."""
    return Serving(version, epoch, dataclasses.replace(handle, order=epoch), training)


async def _scoped(published: Any, scope: str | None) -> SamplerHandle:
    """A published handle of the chain ``scope`` names (a scenario's, or None): a sampler that holds
    several versions at once (vLLM's adapters) keeps each chain's apart."""
    return dataclasses.replace(await published, scope=scope)


def _candidate_line(entry: dict[str, Any], completions: int, lane: Lane) -> str:
    version, outcome = entry["version"], entry["outcome"]
    incumbent = lane.serving.version if lane.serving is not None else entry.get("parent")
    if outcome == "published":
        return (
            f"headrace serve: published {lane.shown(version)} (trained on {completions} scored completions of "
            f"version {entry['parent']}); serving it now"
        )
    why = {
        "rejected": "rejected by the gate",
        "discarded": "discarded (the incumbent changed while it trained)",
        "failed": f"failed ({entry.get('error', '?')})",
    }.get(outcome, outcome)
    return f"headrace serve: candidate {lane.shown(version)} {why}; version {incumbent} goes on serving"
