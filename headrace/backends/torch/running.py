"""The torch sampler's device side: the batches being decoded, and how requests join and leave them.

Runs on the device thread only (``sampler.py`` is the side the event loop calls). A request is
split into parts (``Part``: a request with more rows than ``max_batch`` fills several batches);
each part becomes a ``Member`` of one ``Generation`` (``generate.py``), which keeps the KV cache of
its rows.

Continuous batching (``open`` batches: the ``window`` batching of serving, ``async`` and
``inflight``): between two decode steps the parts that arrived meanwhile join a running batch of
the same weights (prefilled on their own, one forward per distinct prompt, then concatenated into
its cache), as many rows as ``max_batch`` leaves room for across every open batch; the rest wait
for rows to leave. A part leaves its batch as soon as all its rows have ended, and is answered
then; a part whose request was cancelled (its group's retry budget spent, its caller gone) leaves
at the next step without being answered. Neither changes what the other rows compute beyond
float round-off (``tests/test_torch_continuous.py``). Closed batches (``settled``, ``alone``) take
no joiners: their requests were grouped by the run's code, and a seeded run repeats itself only
if they stay so.

Versions: a batch holds one weights version at a time. Under ``async`` each version's requests
form their own batch, and the older ones drain while the newer fill. Once in-flight swaps are on
(``swap_weights``, the ``inflight`` scheduler), a batch whose requests follow the current weights
takes the newest version before its next step (``Generation.reweigh``); tokens are stamped with
the version that drew them, and a request issued with an older handle than the newest swap (an
evaluation pinning its version) keeps it to its end, in a batch of its own version.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import groupby

import torch

from headrace.core.types import SampledTokens, SamplerHandle, SamplingParams

from .device_thread import Answers
from .flops import PerfMeter
from .generate import Generation, Generator, Member, Row, RowResult
from .weights import PublishedWeights, SamplerModel


@dataclass(eq=False)
class Request:
    handle: SamplerHandle
    prompt: list[int]
    n: int
    params: SamplingParams
    seed: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    follows: bool = True  # takes weights swapped in while it runs (issued with the current ones)
    generator: torch.Generator | None = None  # made on the device thread, kept across parts
    results: dict[int, list[SampledTokens]] = field(default_factory=dict)  # by the part's first row

    def settled(self) -> bool:
        return sum(len(r) for r in self.results.values()) == self.n

    def gone(self) -> bool:
        """Nobody waits for it any more (cancelled, or failed in another part)."""
        return self.future.cancelled() or self.future.done()


@dataclass(eq=False)
class Part:
    """Rows ``first`` .. ``first + take`` of a request, decoded in one batch."""

    request: Request
    first: int
    take: int


@dataclass(eq=False)
class Batch:
    generation: Generation
    weights: PublishedWeights
    follows: bool
    open: bool  # takes joiners between steps (continuous batching)

    @property
    def key(self) -> tuple[int, bool]:
        return self.generation.version, self.follows

    def parts(self) -> list[Part]:
        return [m.tag for m in self.generation.members]


class RunningBatches:
    def __init__(
        self,
        model: SamplerModel,
        generator: Generator,
        device: torch.device,
        stops: frozenset[int],
        max_batch: int,
        swap_mode: str,
        meter: PerfMeter | None,
    ):
        self._model, self._generator, self._device = model, generator, device
        self._stops, self.max_batch = stops, max_batch
        self.swap_mode = swap_mode
        self.meter = meter
        self.running: list[Batch] = []
        self.batches = 0  # batches started (a part that joins a running one starts none)
        self.rows = 0  # rows admitted
        self.joined = 0  # of them, rows that joined a batch already decoding
        self.abandoned = 0  # rows that left a batch unanswered (their request cancelled)
        # (version, batch rows, decode steps done before it, seconds) per swap into a running batch
        self.swaps: deque[tuple[int, int, int, float]] = deque(maxlen=10_000)

    def open_rows(self) -> int:
        return sum(len(b.generation.rows) for b in self.running if b.open)

    # ---- admission ----

    def admit(
        self,
        parts: list[Part],
        live: SamplerHandle | None,
        open: bool,
        answers: Answers,
        into: list[Batch] | None = None,
    ) -> list[Part]:
        """Start or join batches with ``parts`` (open: into running batches of their weights, within
        ``max_batch`` rows in all; closed: batches of their own, added to ``into`` if given, else
        to the running ones); the parts left waiting for room."""
        into = self.running if into is None else into
        parts = [p for p in parts if not p.request.gone()]

        def weights(p: Part) -> SamplerHandle:
            # a request that follows the current weights starts with the newest ones
            r = p.request
            return live if r.follows and live is not None and live.version > r.handle.version else r.handle

        room = self.max_batch - self.open_rows() if open else None
        admitted, waiting = [], []
        for p in parts:
            if room is None:
                admitted.append(p)
            elif room > 0:
                take = min(p.take, room)
                admitted.append(Part(p.request, p.first, take))
                if take < p.take:
                    waiting.append(Part(p.request, p.first + take, p.take - take))
                room -= take
            else:
                waiting.append(p)
        # one version per batch; sorting keeps the order of requests within a version
        admitted.sort(key=lambda p: (weights(p).version, not p.request.follows))
        for (_, follows), same in groupby(admitted, key=lambda p: (weights(p).version, p.request.follows)):
            same_key = list(same)
            handle = weights(same_key[0])
            for chunk in self._chunks(same_key):
                generation = self._start(chunk, handle, answers)
                if generation is None:
                    continue
                self.rows += len(generation.rows)
                host = self._host(generation, follows) if open else None
                if host is None:
                    into.append(Batch(generation, handle.ref, follows, open))
                    self.batches += 1
                    continue
                try:
                    self._model.use(host.weights)
                    if host.generation.started:
                        self.joined += len(generation.rows)
                    host.generation.absorb(generation)
                except BaseException as e:  # noqa: BLE001 - the joiners' error, not the batch's
                    for m in generation.members:
                        answers.fail(m.tag.request.loop, m.tag.request.future, e)
        return waiting

    def _host(self, joiners: Generation, follows: bool) -> Batch | None:
        for batch in self.running:
            if batch.open and batch.follows == follows and batch.generation.can_absorb(joiners):
                return batch
        return None

    def _chunks(self, parts: list[Part]) -> Iterator[list[Part]]:
        """Lists of parts with at most max_batch rows in all; a part larger than the room left is
        split, its request's generator carrying on from one part to the next."""
        chunk, size = [], 0
        for p in parts:
            done = 0
            while done < p.take:
                take = min(p.take - done, self.max_batch - size)
                chunk.append(Part(p.request, p.first + done, take))
                size, done = size + take, done + take
                if size == self.max_batch:
                    yield chunk
                    chunk, size = [], 0
        if chunk:
            yield chunk

    def _start(self, chunk: list[Part], handle: SamplerHandle, answers: Answers) -> Generation | None:
        try:
            return self._generation(chunk, handle)
        except BaseException as e:  # noqa: BLE001 - the error belongs to the requests, not the thread
            error = e
        # one request's parameters (a seed or a top_k no tensor holds) must not fail the others:
        # each is tried alone, those at fault get their own error, the rest are batched again
        fine = [p for p in chunk if self._fine_alone(p, handle, answers)]
        if fine and len(fine) < len(chunk):
            return self._start(fine, handle, answers)
        for p in fine:  # none is at fault alone: the batch's error is theirs
            answers.fail(p.request.loop, p.request.future, error)
        return None

    def _fine_alone(self, part: Part, handle: SamplerHandle, answers: Answers) -> bool:
        try:
            self._generation([part], handle)
        except BaseException as e:  # noqa: BLE001 - as above
            answers.fail(part.request.loop, part.request.future, e)
            return False
        return True

    def _generation(self, chunk: list[Part], handle: SamplerHandle) -> Generation:
        members = []
        for part in chunk:
            request = part.request
            if request.generator is None:
                request.generator = torch.Generator(device=self._device).manual_seed(request.seed)
            p = request.params
            stops = self._stops | frozenset(p.stop_token_ids)
            row = Row(request.prompt, p.max_tokens, p.temperature, p.top_p, p.top_k, stops, request.generator)
            members.append(Member(part, [row] * part.take))
        return Generation(self._generator, members, handle.version)

    # ---- decoding ----

    def prepare(self, live: SamplerHandle | None, answers: Answers) -> None:
        """Between two steps: the parts nobody waits for leave their batch, and each batch that
        follows the current weights takes the newest (so joiners of that version find it)."""
        for batch in list(self.running):
            gone = [m for m in batch.generation.members if m.tag.request.gone()]
            self.abandoned += sum(len(m.rows) for m in gone)
            batch.generation.drop(gone)
            if batch.generation.done:
                self.running.remove(batch)
                continue
            if batch.follows and live is not None and live.version > batch.generation.version:
                if not self._swap(batch, live, answers):
                    self.running.remove(batch)

    def step(self, steps: int | None, answers: Answers, batches: list[Batch] | None = None) -> None:
        """Up to ``steps`` tokens (None: to the end) of every running batch (or of ``batches``,
        one after the other); the parts that end are answered."""
        batches = self.running if batches is None else batches
        for batch in list(batches):
            if self._advance(batch, steps, answers):
                batches.remove(batch)

    def fail_all(self, error: BaseException, answers: Answers) -> None:
        for batch in self.running:
            for part in batch.parts():
                answers.fail(part.request.loop, part.request.future, error)
        self.running.clear()

    def _advance(self, batch: Batch, steps: int | None, answers: Answers) -> bool:
        """Decode up to ``steps`` tokens of the batch; True once it is over (done or failed)."""
        generation = batch.generation
        try:
            self._model.use(batch.weights)
            ended = generation.advance(steps)
        except BaseException as e:  # noqa: BLE001 - the error belongs to the requests, not the thread
            for part in batch.parts():
                answers.fail(part.request.loop, part.request.future, e)
            return True
        for member in ended:
            done: Part = member.tag
            request = done.request
            results = member.results()
            request.results[done.first] = [_sampled(r) for r in results]
            if self.meter is not None:
                self.meter.add("decode", tokens=sum(len(r.tokens) for r in results))
            if request.settled():
                answers.give(
                    request.loop, request.future, [s for k in sorted(request.results) for s in request.results[k]]
                )
        return generation.done

    def _swap(self, batch: Batch, live: SamplerHandle, answers: Answers) -> bool:
        generation = batch.generation
        try:
            begun = time.perf_counter()
            self._model.use(live.ref)
            if generation.reweigh(live.version, self.swap_mode):  # else it starts with them
                if self._device.type == "cuda":
                    torch.cuda.synchronize(self._device)  # the swap's own time, not the next step's
                self.swaps.append((live.version, len(generation.rows), generation.step, time.perf_counter() - begun))
        except BaseException as e:  # noqa: BLE001 - the error belongs to the requests, not the thread
            for part in batch.parts():
                answers.fail(part.request.loop, part.request.future, e)
            return False
        batch.weights = live.ref
        return True


def _sampled(row: RowResult) -> SampledTokens:
    versions = row.versions
    if not versions:
        return SampledTokens(row.tokens, row.logprobs, row.stop_reason)
    per_token = versions if versions[0] != versions[-1] else None  # versions only ever grow
    return SampledTokens(row.tokens, row.logprobs, row.stop_reason, versions[0], per_token)
