"""``sim``: no model, a seeded latency model, and tokens that say which weights made them.

Sampling costs ``sample_request_s + tokens · sample_token_s`` (lognormal jitter optional) with at
most ``sample_concurrency`` requests served at once. Training runs on one virtual device in
submission order: ``forward_backward`` costs ``train_step_s + tokens · train_token_s``, an optimizer
step ``optim_step_s``; with ``clock_cycle_s`` set, work only starts on a cycle boundary (Tinker's
lock-step clock). Nothing sleeps in a thread: completion is scheduled on the event loop, and
every call is recorded in ``timeline`` so tests can check the pipelining from what happened.

Every sampled action starts with a version stamp token ``VERSION_BASE + version``: staleness can
be checked from the trained data itself.

Mid-generation weight swaps (``inflight_swap``; the ``inflight`` scheduler calls
``swap_weights``): a request that is running when new weights arrive goes on with them. Its
tokens come out at an even pace over its modelled cost (``sample_request_s`` of prefill, then
``sample_token_s`` per token, both scaled by the jitter), and each token is stamped with the
newest version swapped in before its own time (``SampledTokens.token_versions``); a request that
waited for a slot starts with the newest weights, not the ones it was submitted with. The cost is
unchanged by a swap: the KV cache is kept, as PipelineRL does. The rest of an action is a few random digits and an
end token, so arithmetic-style envs see a chance-level reward that varies within groups.

Every sample request is recorded in ``SimSampling.requests`` (its modelled cost and when it held a
slot) as it returns, so the benchmarks can compute the sampling work actually done (the run's
trace says which rollout each request served: see ``headrace/bench/harness.py``).
"""

from __future__ import annotations

import asyncio
import math
import operator
import random
from _random import Random as _MersenneTwister
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from headrace.core.protocols import BackendContext, BackendPlugin, TransientBackendError
from headrace.core.types import (
    AdamParams,
    Datum,
    ForwardBackwardResult,
    LossSpec,
    OptimResult,
    SampledTokens,
    SamplerHandle,
    SamplingParams,
    StopReason,
    Tokens,
)
from headrace.tokenizers.char import CharTokenizer

VERSION_BASE = 1_000_000


class SimConfig(BaseModel):
    """The sim backend's latency model (seconds). Deterministic given the run seed."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    sample_request_s: float = Field(0.0, ge=0.0, description="fixed cost per sample request")
    sample_token_s: float = Field(0.0, ge=0.0, description="cost per sampled token")
    sample_concurrency: int = Field(64, ge=1, description="most sample requests served at once")
    sample_jitter: float = Field(0.0, ge=0.0, description="lognormal sigma on sample latency")
    train_token_s: float = Field(0.0, ge=0.0, description="forward_backward cost per datum token")
    train_step_s: float = Field(0.0, ge=0.0, description="fixed cost per forward_backward call")
    optim_step_s: float = Field(0.0, ge=0.0, description="cost per optimizer step")
    clock_cycle_s: float = Field(0.0, ge=0.0, description="Tinker-style lock-step cycle; 0 = off")
    action_tokens: int = Field(0, ge=0, description="fixed action length in tokens; 0 = 1-2 digits and an end token")
    length_sigma: float = Field(0.0, ge=0.0, description="lognormal sigma on action length (a long tail)")
    max_context: int = Field(0, ge=0, description="context length the sim claims; 0 = unlimited")
    record_limit: int = Field(
        10_000, ge=0, description="newest calls kept in the sim's timelines (memory stays bounded)"
    )
    sample_fail_rate: float = Field(
        0.0, ge=0.0, le=1.0, description="fault injection: share of sample calls failing transiently"
    )
    sample_fatal_rate: float = Field(
        0.0, ge=0.0, le=1.0, description="fault injection: share of sample calls failing for good (the run stops)"
    )
    train_fail_rate: float = Field(
        0.0, ge=0.0, le=1.0, description="fault injection: share of training submissions refused transiently"
    )


plugin = BackendPlugin(
    "sim",
    SimConfig,
    "headrace.backends.sim:make_backend",
    description="no model: a seeded latency model whose tokens say which weights made them (tests, benchmarks)",
    extra_sample_tokens=1,  # the version stamp
)


def stamped_version(tokens: Sequence[int]) -> int | None:
    """The weight version a sim action was sampled with, read back from its tokens."""
    for t in tokens:
        if t >= VERSION_BASE:
            return t - VERSION_BASE
    return None


@dataclass(frozen=True)
class Span:
    op: str
    submitted: float
    start: float
    end: float
    tokens: int = 0


class SimTraining:
    def __init__(self, cfg: SimConfig, state: dict[str, Any], seed: int = 0):
        self.cfg = cfg
        self.state = state  # shared with the sampler: the "weights" are just a version counter
        # bounded records, so a long run's memory stays flat; tests and benchmarks are shorter
        self.timeline: deque[Span] = deque(maxlen=cfg.record_limit)
        self.trained_versions: deque[tuple[int, int]] = deque(
            maxlen=cfg.record_limit
        )  # (step, stamped version) per datum
        self._faults = random.Random(seed ^ 0x7A11)  # fault injection draws, apart from the data
        self.refused = 0
        self._free_at = 0.0
        self._pending_grads = 0
        self.applied_steps = 0
        self.deleted_states: deque[str] = deque(maxlen=cfg.record_limit)

    def _schedule(self, op: str, duration: float, value: Any, tokens: int = 0) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        now = loop.time()
        start = max(now, self._free_at)
        cycle = self.cfg.clock_cycle_s
        if cycle > 0:
            start = math.ceil(start / cycle - 1e-9) * cycle
        end = start + duration
        self._free_at = end
        self.timeline.append(Span(op, now, start, end, tokens))
        future = loop.create_future()
        if end <= now:
            future.set_result(value)
        else:
            loop.call_at(end, _resolve, future, value)
        return future

    def forward_backward(self, datums: Sequence[Datum], loss: LossSpec) -> asyncio.Future:
        if self.cfg.train_fail_rate and self._faults.random() < self.cfg.train_fail_rate:
            self.refused += 1  # refused at submission: nothing was applied, so a retry is safe
            raise TransientBackendError("sim: training call refused (injected fault)")
        tokens = sum([len(d.model_input) for d in datums])
        for d in datums:
            version = stamped_version(d.target_tokens)
            self.trained_versions.append((self.applied_steps, d.policy_version if version is None else version))
        self._pending_grads += 1
        # per token at C speed (``Datum`` has checked that the lengths agree): the same sum, in order
        loss_sum = -sum([x for d in datums for x in map(operator.mul, d.advantages, d.mask)])
        result = ForwardBackwardResult(
            logprobs_D=[list(d.logprobs) for d in datums],
            metrics={"loss:sum": loss_sum, "tokens:sum": float(tokens)},
        )
        return self._schedule(
            "forward_backward", self.cfg.train_step_s + tokens * self.cfg.train_token_s, result, tokens
        )

    def optim_step(self, adam: AdamParams) -> asyncio.Future:
        if self._pending_grads == 0:
            raise RuntimeError("optim_step with no accumulated gradients")
        self._pending_grads = 0
        self.applied_steps += 1
        self.state["version"] = self.applied_steps
        return self._schedule("optim_step", self.cfg.optim_step_s, OptimResult({"lr": adam.learning_rate}))

    def publish(self, version: int) -> asyncio.Future:
        self.applied_steps = version  # a step with no data still advances the version
        return self._schedule("publish", 0.0, SamplerHandle(version, ref=version))

    async def save_state(self, name: str) -> str:
        await self._schedule("save_state", 0.0, None)
        return f"sim://{name}?step={self.applied_steps}"

    async def load_state(self, path: str) -> None:
        if not path.startswith("sim://") or "?step=" not in path:
            raise ValueError(f"'{path}' is not a sim checkpoint")
        self.applied_steps = int(path.rsplit("=", 1)[1])

    async def delete_state(self, path: str) -> None:
        """A checkpoint the run no longer keeps (``checkpoint.keep_last``): nothing is stored,
        so it is only recorded, for tests."""
        self.deleted_states.append(path)


@dataclass(frozen=True)
class SampleRequest:
    """One sample call as the latency model served it (loop-clock seconds)."""

    submitted: float
    start: float  # a concurrency slot was free
    end: float
    cost: float  # modelled latency, jitter included
    n: int
    tokens: int  # sampled tokens, all n samples
    version: int


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


class SimSampling:
    def __init__(self, cfg: SimConfig, tokenizer: CharTokenizer, seed: int):
        self.cfg, self.tokenizer, self.seed = cfg, tokenizer, seed
        self._slots = asyncio.Semaphore(cfg.sample_concurrency)
        self._digits = tokenizer.encode("0123456789")
        self.requests: deque[SampleRequest] = deque(maxlen=cfg.record_limit)
        self._faults = random.Random(seed ^ 0x5A4D)  # fault injection draws, apart from the data
        self._draws = random.Random()  # reseeded per request: see sample()
        self.injected = {"transient": 0, "fatal": 0}
        self.max_context = cfg.max_context or None  # read by the engine's prompt check
        self.inflight_swap = True  # the engine may call swap_weights during a generation
        self._live: int | None = None  # newest version swapped in; None: swap mode unused
        self.swaps: deque[tuple[float, int]] = deque(maxlen=max(cfg.record_limit, 1))  # (loop time, version)

    def swap_weights(self, handle: SamplerHandle) -> None:
        """New weights for every request from now on, the running ones included."""
        self._live = handle.version if self._live is None else max(self._live, handle.version)
        self.swaps.append((asyncio.get_running_loop().time(), handle.version))

    def _version_at(self, t: float, floor: int) -> int:
        version = floor
        for at, v in reversed(self.swaps):
            if at <= t:
                return max(version, v)
        return version

    async def sample(
        self, handle: SamplerHandle, prompt: Tokens, n: int, params: SamplingParams
    ) -> list[SampledTokens]:
        if self.cfg.sample_fail_rate or self.cfg.sample_fatal_rate:
            self._inject_fault()
        # seeded per request (never from a shared stream), so results don't depend on scheduling
        # the draw leaves the version out: every scheduler samples the same lengths for the same
        # problem (their wall times compare like with like), and a group restarted with newer
        # weights is as long as before (a hard problem stays hard)
        # one generator reseeded in C, the same state as ``random.Random(key)`` at half the cost
        # (the constructor seeds twice, and its Python ``seed`` wrapper checks the type first): it
        # is shared by concurrent requests, so every draw of a request is made before its await
        rng = self._draws
        _MersenneTwister.seed(rng, hash((self.seed, params.seed or 0, tuple(prompt))))
        rng.gauss_next = None  # type: ignore[attr-defined]  # as Random.seed resets it
        samples = [self._one(handle, prompt, params, rng) for _ in range(n)]
        cost = self.cfg.sample_request_s + max(len(s.tokens) for s in samples) * self.cfg.sample_token_s
        if self.cfg.sample_jitter:
            cost *= rng.lognormvariate(0.0, self.cfg.sample_jitter)
        loop = asyncio.get_running_loop()
        submitted = loop.time()
        async with self._slots:
            start = loop.time()
            first = handle.version if self._live is None else max(handle.version, self._live)
            await asyncio.sleep(cost)
        if self._live is not None:
            base = self.cfg.sample_request_s + max(len(s.tokens) for s in samples) * self.cfg.sample_token_s
            scale = cost / base if base > 0 else 0.0  # the jitter: every token of the call is as slow
            samples = [self._swapped(s, start, scale, first) for s in samples]
        tokens = sum(len(s.tokens) for s in samples)
        self.requests.append(SampleRequest(submitted, start, loop.time(), cost, n, tokens, first))
        return samples

    def _swapped(self, sample: SampledTokens, start: float, scale: float, first: int) -> SampledTokens:
        """Restamp a sample served across weight swaps: token j comes out after the prefill and
        j + 1 token times (jitter scaled), made by the newest weights swapped in by then."""
        cfg = self.cfg
        times = [
            start + scale * (cfg.sample_request_s + (j + 1) * cfg.sample_token_s) for j in range(len(sample.tokens))
        ]
        versions = [self._version_at(t, first) for t in times]
        tokens = [VERSION_BASE + versions[0], *sample.tokens[1:]]
        per_token = tuple(versions) if versions[-1] != versions[0] else None
        return SampledTokens(tokens, sample.logprobs, sample.stop_reason, versions[0], per_token)

    def _inject_fault(self) -> None:
        draw = self._faults.random()
        if draw < self.cfg.sample_fail_rate:
            self.injected["transient"] += 1
            raise TransientBackendError("sim: sampler unavailable (injected transient fault)")
        if draw < self.cfg.sample_fail_rate + self.cfg.sample_fatal_rate:
            self.injected["fatal"] += 1
            raise RuntimeError("sim: sampler crashed on this request (injected fault)")

    def _one(self, handle: SamplerHandle, prompt: Tokens, params: SamplingParams, rng: random.Random) -> SampledTokens:
        eos = self.tokenizer.eos_token_id
        # ``rng.choice``'s draws as ``Random._randbelow`` makes them (the same stream, so the same
        # tokens), written out since this runs per trajectory: getrandbits(2) until < 2 for the
        # length, getrandbits(4) until < 10 per digit
        bits = rng.getrandbits
        if self.cfg.action_tokens:
            n_digits = self.cfg.action_tokens - 1
        else:
            r = bits(2)
            while r >= 2:
                r = bits(2)
            n_digits = r + 1  # (1, 2)[r]
            if self.cfg.length_sigma:
                n_digits = max(1, round(n_digits * rng.lognormvariate(0.0, self.cfg.length_sigma)))
        digits = self._digits
        tokens = [VERSION_BASE + handle.version]  # the version stamp, then the body, then eos
        for _ in range(n_digits):
            r = bits(4)
            while r >= 10:
                r = bits(4)
            tokens.append(digits[r])
        tokens.append(eos)
        limit = max(1, params.max_tokens)  # the stamp stays; the body is cut to max_tokens - 1
        if len(tokens) > limit:
            del tokens[limit:]
        stop = StopReason.STOP if tokens[-1] == eos else StopReason.LENGTH
        return SampledTokens(tokens, [-1.0] * len(tokens), stop, handle.version)


class SimBackend:
    def __init__(self, config: SimConfig, ctx: BackendContext):
        self.tokenizer = CharTokenizer()
        self._state: dict[str, Any] = {"version": 0}
        self.training = SimTraining(config, self._state, ctx.seed)
        self.sampling = SimSampling(config, self.tokenizer, ctx.seed)

    def initial_handle(self) -> SamplerHandle:
        return SamplerHandle(0, ref=0)

    def describe(self) -> dict[str, Any]:
        return {"backend": "sim", "model": "none"}

    # the "weights" are the version number: nothing travels to a sampler in another process
    @staticmethod
    def weights_of(handle: SamplerHandle) -> None:
        return None

    def handle_for(self, version: int, weights: None) -> SamplerHandle:
        return SamplerHandle(version, ref=version)

    async def __aenter__(self) -> SimBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


def make_backend(config: SimConfig, ctx: BackendContext) -> SimBackend:
    return SimBackend(config, ctx)
