"""The ideal bound: how fast a run could have gone on its latency model with a free engine.

The ``sim`` backend records the work a run actually asked for: every sample request with its
modelled cost (jitter included) (``SimSampling.requests``; the run's trace says which rollout
each served), and every training call with its modelled duration (``SimTraining.timeline``).
The ideal bound replays that same work through the latency model and the scheduler's rules
with zero engine cost: no Python time, no event-loop wake-up latency, the learner never idle
while it has data, the sampler never idle while it has requests. The efficiency of a run is
``ideal / actual`` wall time (1.0 = the engine costs nothing).

Inputs, per batch k (the batch trained at step k):

* per group g: ``chain_g`` = the cost of its shared first request (one ``n=G`` sample) + the
  longest sum of request costs of one member after it (multi-turn turns and retries are
  sequential within a member); ``work_g`` = the sum of its request costs (request-seconds).
* ``S_k = max(max_g chain_g, W_k / C)`` where ``W_k = Σ_g work_g`` and ``C`` is the sampler's
  concurrency (``sim.sample_concurrency``): no schedule samples batch k faster than its longest
  chain, nor than its work spread over every slot. This is batch k's sampling critical path.
* the training ops of step k in submission order, each with its modelled duration
  (``train_step_s + tokens · train_token_s`` per ``forward_backward``, ``optim_step_s``, 0 for
  ``publish``); ``T_k`` = their sum.

The replay (``lag`` = how many steps sampling may run ahead: 0 for ``sync``/``stream``,
``max_steps_off_policy`` for ``async``; ``M`` = forward_backward calls per step)::

    A_k  = 0 if k <= lag else P_(k-lag-1)          batch k admitted when version k-lag is published
    R_k  = max(A_k + max_g chain_g,                  batch k fully sampled, at the earliest
               max_(j<=k) (A_j + Σ_(i=j..k) W_i / C))  (the sampler's slots are shared by batches)
    R_k(r) = A_k + max(r-th smallest chain_g, (sum of the r smallest work_g) / C)
                                                     the first r groups of batch k, at the earliest
    fb m of step k starts at align(max(device free, R_k(r_m))), r_m = min((m+1)·ceil(B/M), B)
    optim and publish follow on the device (they are submitted once batch k is whole)
    align(t) = t, or the next clock boundary when sim.clock_cycle_s is set (at the run's phase)
    P_k  = end of step k's publish;  ideal = P_(N-1)

Every term is a lower bound on what any schedule can do with the same work, so ``ideal ≤ actual``
up to timer noise. Special cases, which the replay reduces to (and the JSON reports as
``sampling_s`` = Σ S_k and ``training_s`` = Σ T_k):

* ``sync`` (lag 0, M = 1): ``ideal = Σ_k (S_k + T_k)`` (with the clock: plus the wait for a
  boundary before each step's first call).
* ``async`` with a sampler that one batch saturates: the two-stage pipeline bound
  ``max(S_0 + Σ_k T_k, Σ_k S_k + T_(N-1))`` = max(total sampling, total training) + the
  unavoidable first sampling or last training. With spare sampler slots it is lower still: two
  admitted batches then sample side by side.
* ``stream`` (lag 0, M > 1): minibatch m's ``forward_backward`` may start once its groups are
  done, so training overlaps the batch's slowest rollouts; each extra call costs ``train_step_s``.

``inflight`` (admission by samples; ``inflight_bound``): the batch-level terms above no longer
apply, since a step takes whichever groups finish first. Its ideal is an event-by-event replay of
the same recorded work under inflight's own rules with a free engine:

* groups in the dataset's order, each admitted the moment ``uncommitted + 1 ≤ (B − c) + (v + m −
  s)·B`` holds (v = published version, s = the step being filled, c = groups given to it so far,
  m = ``max_steps_off_policy``), with deadline v + m; no Python time between events;
* each group's requests as recorded: its shared first request, then each member's own requests
  one after another, each after the env's step time (``env_step_s``: the scenario's declared tool
  latency, ``env_options.tool_s``; 0 for the other envs); a request holds one of the C slots for
  its recorded cost, slots served first come first served, never idle while a request waits;
* finished groups given to steps earliest deadline first, exactly as ``InflightGate`` does
  (a step is held for a group that is due: the ``hold`` rule);
* step s's recorded training ops on the device, in order, from the moment its B-th group is given
  to it (and the device is free, on a clock boundary if there is a clock); its publish makes
  version s+1.

``ideal`` = the end of the last publish. It is what this scheduler's rules give with the work
the run did and a free engine; unlike the batch-level bound it is not a minimum over every
possible schedule (a luckier order of requests could beat it slightly). Training ops are replayed
by step index with their recorded durations (a step's tokens depend on which groups it took;
the sum over steps is the same). A group restarted by ``regenerate`` is in the work only with
its kept requests (a cancelled request is not recorded).

Not modelled (so not in the bound): env time other than ``env_step_s`` (the sim's envs take none)
and the final checkpoint save. Retried rollouts' requests are in the work: the bound says how fast
the work that was done could have been done, not how much work a fault cost.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class GroupWork:
    chain: float  # seconds: shared first request + the slowest member's own requests (and env steps)
    work: float  # request-seconds
    first: float | None = None  # the shared first request's cost; None: none was made
    members: tuple[tuple[float, ...], ...] = ()  # each member's own request costs, in order


@dataclass(frozen=True)
class Work:
    """What a run asked of the latency model: per batch its groups, per step its training ops."""

    batches: list[list[GroupWork]]
    steps: list[list[tuple[str, float]]]  # (op, modelled seconds), in submission order


@dataclass(frozen=True)
class IdealBound:
    ideal_s: float
    sampling_s: float  # Σ_k S_k
    training_s: float  # Σ_k T_k
    step_end_s: list[float] = field(default_factory=list)  # P_k, for plots


def sampling_path(groups: Sequence[GroupWork], concurrency: int) -> float:
    """S_k: batch k's sampling critical path."""
    if not groups:
        return 0.0
    return max(max(g.chain for g in groups), sum(g.work for g in groups) / concurrency)


def ideal_bound(
    work: Work,
    lag: int,
    minibatches: int,
    concurrency: int,
    clock_cycle_s: float = 0.0,
    phase: float = 0.0,
) -> IdealBound:
    """Replay ``work`` through the latency model with a free engine (see the module docstring)."""

    def align(t: float) -> float:
        if clock_cycle_s <= 0:
            return t
        return phase + math.ceil((t - phase) / clock_cycle_s - 1e-9) * clock_cycle_s

    publish_end: list[float] = []
    free = 0.0
    fluid = -math.inf  # max_j (A_j − Σ_(i<j) W_i / C)
    done_work = 0.0  # Σ_(i<k) W_i
    sampling_s = training_s = 0.0
    for k, ops in enumerate(work.steps):
        groups = work.batches[k] if k < len(work.batches) else []
        admitted = publish_end[k - lag - 1] if k - lag - 1 >= 0 else 0.0
        fluid = max(fluid, admitted - done_work / concurrency)
        batch_work = sum(g.work for g in groups)
        done_work += batch_work
        chains = sorted(g.chain for g in groups)
        works = sorted(g.work for g in groups)
        whole = max(admitted + (chains[-1] if chains else 0.0), fluid + done_work / concurrency)
        sampling_s += sampling_path(groups, concurrency)
        size = len(groups)
        per = math.ceil(size / minibatches) if size else 0
        fb = 0
        for op, seconds in ops:
            ready = whole
            if op == "forward_backward" and size:
                r = min((fb + 1) * per, size)
                fb += 1
                if r < size:
                    ready = admitted + max(chains[r - 1], sum(works[:r]) / concurrency)
            start = align(max(free, ready))
            free = start + seconds
            training_s += seconds
        publish_end.append(free)
    return IdealBound(publish_end[-1] if publish_end else 0.0, sampling_s, training_s, publish_end)


def work_from_records(
    requests: Iterable[tuple[tuple[int, int, int] | None, float]], timeline: Iterable[Any], env_step_s: float = 0.0
) -> Work:
    """Build ``Work`` from (rollout served, modelled cost) per sample request and the sim's
    training timeline. Requests that served no rollout (an evaluation's) are not in the bound.
    ``env_step_s``: env time before each of a member's own requests (a tool call's latency)."""
    first: dict[tuple[int, int], float] = {}
    members: dict[tuple[int, int], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    totals: dict[tuple[int, int], float] = defaultdict(float)
    for rollout, cost in requests:
        if rollout is None:
            continue
        batch, group, member = rollout
        key = (batch, group)
        totals[key] += cost
        if member < 0:
            first[key] = first.get(key, 0.0) + cost
        else:
            members[key][member].append(cost)
    by_batch: dict[int, list[GroupWork]] = defaultdict(list)
    for key in sorted(totals):
        chains = [sum(costs) + env_step_s * len(costs) for costs in members[key].values()]
        chain = first.get(key, 0.0) + max(chains, default=0.0)
        own = tuple(tuple(members[key][m]) for m in sorted(members[key]))
        by_batch[key[0]].append(GroupWork(chain, totals[key], first.get(key), own))
    steps: list[list[tuple[str, float]]] = []
    current: list[tuple[str, float]] = []
    for span in timeline:
        current.append((span.op, span.end - span.start))
        if span.op == "publish":
            steps.append(current)
            current = []
    batches = [by_batch.get(k, []) for k in range(max(len(steps), max(by_batch, default=-1) + 1))]
    return Work(batches, steps)


def inflight_bound(
    work: Work,
    max_steps_off_policy: int,
    batch_size: int,
    concurrency: int,
    env_step_s: float = 0.0,
    clock_cycle_s: float = 0.0,
    phase: float = 0.0,
) -> IdealBound:
    """Replay ``work`` under ``inflight``'s rules with a free engine (see the module docstring)."""
    m, size = max_steps_off_policy, batch_size

    def align(t: float) -> float:
        if clock_cycle_s <= 0:
            return t
        return phase + math.ceil((t - phase) / clock_cycle_s - 1e-9) * clock_cycle_s

    groups = [g for batch in work.batches for g in batch]
    events: list[tuple[float, int, str, Any]] = []  # (time, seq, kind, payload)
    seq = 0

    def at(t: float, kind: str, payload: Any) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    free_slots, queue = concurrency, deque[tuple[int, int, int]]()  # queue: (group, member or -1, request index)
    left: dict[int, int] = {}  # group → members (or the first request) still running
    deadline: dict[int, int] = {}
    pool: list[tuple[int, int, int]] = []  # (deadline, arrival, group)
    arrivals = 0
    version = step = committed = admitted = 0
    device_free = 0.0
    publish_end: list[float] = []
    sampling_s = sum(sampling_path(b, concurrency) for b in work.batches)
    training_s = sum(seconds for ops in work.steps for _, seconds in ops)

    def submit(now: float, g: int, member: int, index: int) -> None:
        nonlocal free_slots
        if free_slots:
            free_slots -= 1
            cost = groups[g].first if member < 0 else groups[g].members[member][index]
            at(now + (cost or 0.0), "done", (g, member, index))
        else:
            queue.append((g, member, index))

    def member_next(now: float, g: int, member: int, index: int) -> None:
        if index < len(groups[g].members[member]):
            at(now + env_step_s, "submit", (g, member, index))
        else:
            finish_member(g)

    def finish_member(g: int) -> None:
        nonlocal arrivals
        left[g] -= 1
        if left[g] == 0:
            heapq.heappush(pool, (deadline.pop(g), arrivals, g))
            arrivals += 1

    def start_members(now: float, g: int) -> None:
        left[g] = len(groups[g].members)
        if not left[g]:
            left[g] = 1
            finish_member(g)
        for member in range(len(groups[g].members)):
            member_next(now, g, member, 0)

    def blocked(head_deadline: int) -> bool:
        due = sorted([*deadline.values(), *(d for d, _, _ in pool[1:])])
        room, i = size - committed - 1, 0
        for t in range(step, head_deadline):
            while i < len(due) and due[i] <= t:
                i += 1
            if i > room + (t - step) * size:
                return True
        return False

    def settle(now: float) -> None:
        nonlocal admitted, committed, step, device_free
        progress = True
        while progress:
            progress = False
            while (
                admitted < len(groups)
                and len(deadline) + len(pool) + 1 <= (size - committed) + (version + m - step) * size
            ):
                g, admitted = admitted, admitted + 1
                deadline[g] = version + m
                if groups[g].first is not None:
                    left[g] = 1
                    submit(now, g, -1, 0)
                else:
                    start_members(now, g)
                progress = True
            while pool and not blocked(pool[0][0]):
                heapq.heappop(pool)
                committed += 1
                progress = True
                if committed == size:
                    ops = work.steps[step] if step < len(work.steps) else []
                    t = align(max(device_free, now))
                    for _, seconds in ops:
                        t = align(t) + seconds
                    device_free = t
                    at(t, "publish", step + 1)
                    step, committed = step + 1, 0

    settle(0.0)
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "publish":
            version = payload
            publish_end.append(now)
            if len(publish_end) == len(work.steps):
                break
        elif kind == "submit":
            submit(now, *payload)
        else:  # a request is done: its slot goes to the next one waiting
            g, member, index = payload
            free_slots += 1
            if queue:
                submit(now, *queue.popleft())
            if member < 0:
                left[g] -= 1
                start_members(now, g)
            else:
                member_next(now, g, member, index + 1)
        settle(now)
    return IdealBound(publish_end[-1] if publish_end else 0.0, sampling_s, training_s, publish_end)
