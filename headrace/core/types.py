"""The types every part of headrace speaks, in one place.

Dimension suffixes on names that hold batches: ``_P`` problems, ``_G`` members of a group,
``_T`` tokens, ``_D`` datums (``tokens_G_T``, ``advantages_G``).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from headrace.core.frozen import quick_init

Metrics = dict[str, float]
Tokens = list[int]


class StopReason(enum.StrEnum):
    """Why a sample (stop, length, context_overflow) or an episode (done, max_turns, context_overflow) ended."""

    STOP = "stop"  # a stop token / string was produced
    LENGTH = "length"  # the sample hit max_tokens
    DONE = "done"  # the env said the episode is over
    MAX_TURNS = "max_turns"
    CONTEXT_OVERFLOW = "context_overflow"  # a sample filled the context; a next prompt no longer fits it
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class StopCondition:
    """How the sampler should stop one action: at most ``max_tokens``, or at a stop token."""

    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()


@quick_init
@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@quick_init
@dataclass(frozen=True)
class SampledTokens:
    """One action as the sampler produced it: token ids and the sampler's own logprobs.

    ``policy_version`` is the learner step whose weights produced its *oldest* token (stamped by
    the sampler actor); -1 means "not stamped yet". ``token_versions`` gives each token's own
    version when the weights changed during the call (``inflight``: tokens after a swap come from
    the new weights); None means every token has ``policy_version``, the default for a backend
    that serves a call with one set of weights.
    """

    tokens: Tokens
    logprobs: list[float]
    stop_reason: StopReason
    policy_version: int = -1
    token_versions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(
                f"SampledTokens has {len(self.tokens)} tokens but {len(self.logprobs)} logprobs; "
                "a sampler must return one logprob per sampled token"
            )
        if self.token_versions is not None:
            if len(self.token_versions) != len(self.tokens):
                raise ValueError(
                    f"SampledTokens has {len(self.tokens)} tokens but {len(self.token_versions)} token versions; "
                    "give one version per sampled token, or None when one version made them all"
                )
            if self.token_versions and min(self.token_versions) != self.policy_version:
                raise ValueError(
                    f"SampledTokens.policy_version is {self.policy_version} but its oldest token has version "
                    f"{min(self.token_versions)}; policy_version must be the oldest token's version"
                )

    @property
    def versions(self) -> list[int]:
        """The version of the weights that produced each token."""
        if self.token_versions is None:
            return [self.policy_version] * len(self.tokens)
        return list(self.token_versions)


@quick_init
@dataclass(frozen=True)
class StepResult:
    reward: float
    done: bool
    next_observation: Tokens = field(default_factory=list)
    next_stop: StopCondition | None = None
    metrics: Metrics = field(default_factory=dict)


class Env(ABC):
    """A single-use episode. Multi-turn is the general case; single-turn is one ``step``."""

    @abstractmethod
    async def initial_observation(self) -> tuple[Tokens, StopCondition]: ...

    @abstractmethod
    async def step(self, action: SampledTokens) -> StepResult: ...


class EnvGroupBuilder(ABC):
    """Makes the G envs of one group (same problem). Must be picklable."""

    @abstractmethod
    async def make_envs(self) -> Sequence[Env]: ...

    async def compute_group_rewards(self, trajectories_G: Sequence[Trajectory]) -> list[tuple[float, Metrics]]:
        """Extra reward per member, seeing the whole group (pairwise judges, games)."""
        return [(0.0, {}) for _ in trajectories_G]

    async def cleanup(self) -> None:  # noqa: B027 - optional hook
        """Always called once the group is finished, dropped or cancelled."""

    def logging_tags(self) -> list[str]:
        return []


class RLDataset(ABC):
    """Batches of group builders, deterministic in the batch index."""

    @abstractmethod
    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]: ...

    @abstractmethod
    def __len__(self) -> int: ...


@quick_init
@dataclass(frozen=True)
class Transition:
    observation: Tokens
    action: SampledTokens
    reward: float
    done: bool
    metrics: Metrics = field(default_factory=dict)


@quick_init
@dataclass(frozen=True)
class Trajectory:
    transitions: list[Transition]
    stop_reason: StopReason

    @property
    def policy_version(self) -> int:
        """The version of the oldest token: staleness is measured from the data."""
        transitions = self.transitions
        if len(transitions) == 1:  # single-turn: no list, no min (this runs several times per trajectory)
            return transitions[0].action.policy_version
        return min([t.action.policy_version for t in transitions], default=-1)

    @property
    def token_versions(self) -> list[int]:
        """Each action token's version, in order (per-token staleness comes from these)."""
        return [v for t in self.transitions for v in t.action.versions]

    def version_counts(self) -> dict[int, int]:
        """Action tokens per version (cheap when each call had one version, the usual case)."""
        counts: dict[int, int] = {}
        for t in self.transitions:
            a = t.action
            if a.token_versions is None:
                counts[a.policy_version] = counts.get(a.policy_version, 0) + len(a.tokens)
            else:
                for v in a.token_versions:
                    counts[v] = counts.get(v, 0) + 1
        return counts

    @property
    def num_action_tokens(self) -> int:
        if len(self.transitions) == 1:
            return len(self.transitions[0].action.tokens)
        return sum([len(t.action.tokens) for t in self.transitions])

    @property
    def total_reward(self) -> float:
        if len(self.transitions) == 1:
            return 0 + self.transitions[0].reward  # sum()'s int start: the same value and type
        return sum([t.reward for t in self.transitions])


@dataclass(frozen=True)
class GroupKey:
    """Where a group came from: its batch and its position in that batch."""

    batch: int
    index: int


@dataclass
class TrajectoryGroup:
    key: GroupKey
    trajectories_G: list[Trajectory]
    rewards_G: list[float]  # total reward per member: step rewards + group reward
    metrics: Metrics
    tags: list[str] = field(default_factory=list)

    @property
    def policy_version(self) -> int:
        return min([t.policy_version for t in self.trajectories_G], default=-1)


@dataclass
class DroppedGroup:
    """A group whose retry budget ran out: counted, never trained."""

    key: GroupKey
    errors: list[str]


@quick_init
@dataclass(frozen=True)
class Datum:
    """One training sequence, Tinker-style: inputs, and per-target-position loss inputs.

    ``model_input[t]`` predicts ``target_tokens[t]``; ``mask`` is 1 on action tokens only.
    """

    model_input: Tokens
    target_tokens: Tokens
    logprobs: list[float]
    advantages: list[float]
    mask: list[float]
    policy_version: int = -1

    def __post_init__(self) -> None:
        n = len(self.model_input)
        if n == len(self.target_tokens) == len(self.logprobs) == len(self.advantages) == len(self.mask):
            return
        for name in ("target_tokens", "logprobs", "advantages", "mask"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Datum.{name} has {len(getattr(self, name))} entries, expected {n}")

    @property
    def num_loss_tokens(self) -> int:
        return int(sum(self.mask))


@dataclass(frozen=True)
class LossSpec:
    """A loss by name, with its options (``loss.*`` of the run config, e.g. the PPO clip bounds).

    The first four names are Tinker's own; the rest are off-policy corrections and variants
    (``headrace/backends/torch/losses.py`` defines each). A backend that cannot compute a name or
    an option refuses it with a ``ConfigError`` that says which ones it can."""

    name: str = "importance_sampling"
    config: Mapping[str, float | str] = field(default_factory=dict)


LOSS_NAMES = ("importance_sampling", "ppo", "cispo", "cross_entropy", "decoupled_ppo", "tis", "mis", "gspo")


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping


@dataclass
class ForwardBackwardResult:
    logprobs_D: list[list[float]]  # per datum, per target position
    metrics: Metrics = field(default_factory=dict)


@dataclass
class OptimResult:
    metrics: Metrics = field(default_factory=dict)


@dataclass(frozen=True)
class SamplerHandle:
    """What a sampler needs to sample from one published set of weights."""

    version: int
    ref: Any = None  # backend-specific: a path, an adapter, a Tinker sampling client
    # whose chain of versions it is: None for a run's or the service's own; with serve.per_scenario
    # the scenario's, whose version 1 is other weights than another scenario's version 1
    scope: str | None = None
    # which of two handles of one scope is the newer, where that is not the version: a serve
    # rollback re-publishes an older version (the chain line that made it the incumbent); None = version
    order: int | None = None


@runtime_checkable
class Tokenizer(Protocol):
    eos_token_id: int

    def encode(self, text: str) -> Tokens: ...

    def decode(self, tokens: Sequence[int]) -> str: ...

    @property
    def vocab_size(self) -> int: ...
