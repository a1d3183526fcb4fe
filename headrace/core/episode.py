"""One episode: prompt → sample → step …, until the env says done or the turn limit.

Or, for a *self-driven* env (an agent that calls the model when it wants, ``headrace.agents``):
``drive(policy)``, awaited in the episode's own task, where each ``policy(prompt, stop)`` call is
one turn (see :class:`SelfDrivenEnv`).
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeGuard, runtime_checkable

from headrace.core.errors import EnvError, RunError
from headrace.core.types import (
    Env,
    Metrics,
    SampledTokens,
    SamplingParams,
    StepResult,
    StopCondition,
    StopReason,
    Tokens,
    Trajectory,
    Transition,
)


class EnvContractError(EnvError, TypeError):
    """An env broke its contract (wrong types, no observation). A bug, never retried."""


class PromptTooLongError(RunError, ValueError):
    """A prompt that leaves no room in the model's context. Deterministic, never retried."""

    def __init__(self, prompt_tokens: int, max_context: int):
        super().__init__(
            f"a prompt of {prompt_tokens} tokens does not fit the model's context of {max_context} tokens; "
            "shorten the env's prompts or use a model with a longer context"
        )


@dataclass(frozen=True)
class EpisodeSpec:
    """What every episode of a run shares: the sampling knobs, the turn limit and the size of
    the tokenizer's vocabulary (None: token ids are not checked)."""

    base_params: SamplingParams
    max_turns: int
    seed: int
    vocab_size: int | None = None


def _contract(env: Env, what: str, problem: str, fix: str) -> EnvContractError:
    return EnvContractError(f"{type(env).__name__}.{what} {problem}; {fix}")


def check_tokens(env: Env, what: str, tokens: object, vocab_size: int | None, sampled: Iterable[Tokens] = ()) -> Tokens:
    """Token ids must be ints the model can read. Ids the sampler produced itself pass (the sim
    stamps its version on every action; a padded embedding can be sampled past the tokenizer)."""
    fix = "token ids are a list[int]: encode text with EnvContext.tokenizer"
    if not isinstance(tokens, list):
        raise _contract(env, what, f"gave the {type(tokens).__name__} {tokens!r:.60} as token ids", fix)
    if not all(type(t) is int for t in tokens):
        odd = next(t for t in tokens if type(t) is not int)
        raise _contract(env, what, f"gave a list holding {odd!r:.60} as token ids", fix)
    if vocab_size and tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        known = {t for action in sampled for t in action}
        bad = [t for t in tokens if not 0 <= t < vocab_size and t not in known]
        if bad:
            raise _contract(
                env,
                what,
                f"gave the token id {bad[0]}, outside the tokenizer's vocabulary (ids 0..{vocab_size - 1})",
                "encode text with EnvContext.tokenizer, the tokenizer of the model in use",
            )
    return tokens


def check_stop(env: Env, what: str, stop: object, vocab_size: int | None) -> StopCondition:
    if not isinstance(stop, StopCondition):
        raise _contract(env, what, f"gave {type(stop).__name__} as the stop condition", "give a headrace.StopCondition")
    if type(stop.max_tokens) is not int or stop.max_tokens <= 0:
        raise _contract(
            env, what, f"gave StopCondition(max_tokens={stop.max_tokens!r})", "max_tokens must be an int >= 1"
        )
    ids = stop.stop_token_ids
    check_tokens(env, f"{what} (stop_token_ids)", list(ids) if isinstance(ids, tuple | list) else ids, vocab_size)
    return stop


def check_observation(env: Env, value: object, vocab_size: int | None = None) -> tuple[Tokens, StopCondition]:
    if (
        not isinstance(value, tuple)
        or len(value) != 2
        or not isinstance(value[0], list)
        or not isinstance(value[1], StopCondition)
    ):
        got = f"({', '.join(type(v).__name__ for v in value)})" if isinstance(value, tuple) else type(value).__name__
        raise EnvContractError(
            f"{type(env).__name__}.initial_observation() returned {got}; it must return "
            "(prompt_tokens: list[int], StopCondition)"
        )
    if not value[0]:
        raise EnvContractError(f"{type(env).__name__}.initial_observation() returned an empty prompt")
    what = "initial_observation()"
    return check_tokens(env, what, value[0], vocab_size), check_stop(env, what, value[1], vocab_size)


def is_real(value: object) -> TypeGuard[numbers.Real]:
    """``isinstance(value, numbers.Real)``, with floats and ints answered before the ABC check
    (which costs about 1 µs, and runs for every reward and metric of every trajectory)."""
    return type(value) is float or type(value) is int or isinstance(value, numbers.Real)


def check_reward(owner: object, what: str, reward: object) -> float:
    """A reward is a real number (a bool, an int, a numpy float), returned as a float; whether it
    is finite is checked apart (``advantages.check_step_rewards``)."""
    if type(reward) is float:
        return reward
    if not is_real(reward):
        raise EnvContractError(
            f"{type(owner).__name__}.{what} gave the reward {reward!r:.80} ({type(reward).__name__}); "
            "a reward must be a number: return float(...)"
        )
    return float(reward)


def check_metrics(owner: object, what: str, metrics: object) -> Metrics:
    if type(metrics) is dict:
        for k, v in metrics.items():
            if type(k) is not str or not (type(v) is float or type(v) is int or is_real(v)):
                break
        else:
            return metrics
    if not isinstance(metrics, dict) or not all(isinstance(k, str) and is_real(v) for k, v in metrics.items()):
        raise EnvContractError(
            f"{type(owner).__name__}.{what} gave metrics {metrics!r:.120}; metrics must be a dict of name -> number"
        )
    return metrics


def check_step(
    env: Env,
    value: object,
    vocab_size: int | None = None,
    sampled: Iterable[Tokens] = (),
    previous: Tokens | None = None,
) -> StepResult:
    """``previous``: the last observation + action, already sound; a next observation that extends
    them (the multi-turn norm) has only its new tokens checked, so a turn costs O(new tokens)."""
    if not isinstance(value, StepResult):
        raise EnvContractError(
            f"{type(env).__name__}.step() returned {type(value).__name__}; it must return a headrace.StepResult"
        )
    check_reward(env, "step()", value.reward)
    check_metrics(env, "step()", value.metrics)
    if not value.done:
        if not value.next_observation:
            raise EnvContractError(
                f"{type(env).__name__}.step() returned done=False with no next_observation; "
                "a multi-turn env must give the next prompt"
            )
        tokens = value.next_observation
        if previous and isinstance(tokens, list) and tokens[: len(previous)] == previous:
            tokens = tokens[len(previous) :]
        check_tokens(env, "step() (next_observation)", tokens, vocab_size, sampled)
        if value.next_stop is not None:
            check_stop(env, "step() (next_stop)", value.next_stop, vocab_size)
    return value


def params_for(spec: EpisodeSpec, stop: StopCondition, seed: int) -> SamplingParams:
    base = spec.base_params
    return SamplingParams(
        max_tokens=stop.max_tokens,
        temperature=base.temperature,
        top_p=base.top_p,
        top_k=base.top_k,
        stop_token_ids=stop.stop_token_ids,
        seed=seed,
    )


async def run_episode(
    env: Env,
    sample,  # async (prompt, n, params) -> list[SampledTokens]
    spec: EpisodeSpec,
    seed: int,
    first: tuple[Tokens, StopCondition, SampledTokens | None] | None = None,
) -> Trajectory:
    """Drive one env to the end. ``first`` carries the env's prompt, already asked for, and the
    action sampled for the whole group at once (one ``n=G`` call when the group shares its
    prompt), or None when the member samples its first action itself."""
    if is_self_driven(env):
        return await drive_episode(env, sample, spec, seed)  # type: ignore[arg-type]
    if first is not None:
        observation, stop, action = first
    else:
        observation, stop = check_observation(env, await env.initial_observation(), spec.vocab_size)
        action = None
    transitions: list[Transition] = []
    for turn in range(spec.max_turns):
        if action is None:
            try:
                (action,) = await sample(observation, 1, params_for(spec, stop, seed * 1000 + turn))
            except PromptTooLongError:
                if not transitions:
                    raise
                # a conversation that outgrew the context ends; it is not the env's fault
                return Trajectory(transitions, StopReason.CONTEXT_OVERFLOW)
        assert isinstance(action, SampledTokens)
        result = await env.step(action)
        if not (type(result) is StepResult and result.done):  # a last step has no next prompt to check
            sampled = [*(t.action.tokens for t in transitions), action.tokens]
            result = check_step(env, result, spec.vocab_size, sampled, observation + action.tokens)
        else:
            result = check_step(env, result, spec.vocab_size)
        transitions.append(Transition(observation, action, float(result.reward), result.done, result.metrics))
        if result.done:
            return Trajectory(transitions, StopReason.DONE)
        observation, stop, action = result.next_observation, result.next_stop or stop, None
    return Trajectory(transitions, StopReason.MAX_TURNS)


# -- self-driven envs ---------------------------------------------------------------------------


Keep = Callable[[SampledTokens], "int | Awaitable[int]"]


class Policy(Protocol):
    """One turn of a self-driven episode: sample an action for ``prompt``. ``keep(action)`` says
    how many of the sampled tokens the env kept (an answer cut at a stop string), or an awaitable
    of it (the env is on a rollout worker: ``backends/ray/workers.py``); the turn records and
    returns that prefix."""

    async def __call__(self, prompt: Tokens, stop: StopCondition, keep: Keep | None = None) -> SampledTokens: ...


@runtime_checkable
class SelfDrivenEnv(Protocol):
    """An env that drives its own episode: an agent that calls the model when it wants (through
    an OpenAI-compatible endpoint) instead of answering ``step``. The episode runner awaits
    ``drive(policy)`` in the episode's own task, so a timeout or a spent retry budget cancels it
    and everything it started. Each ``policy`` call is one turn, checked as an observation,
    sampled by the run's sampler and recorded as a transition (observation: the prompt; action:
    the sampled tokens). A prompt that extends the previous turn's prompt + action continues one
    training sequence; one that does not starts another sequence of the same episode, with the
    same reward (``core/datums.py``). ``drive`` returns the episode's reward and metrics as a
    ``StepResult`` (the reward goes to its last turn). ``initial_observation`` and ``step`` are
    never called."""

    async def drive(self, policy: Policy) -> StepResult: ...


_DRIVES: dict[type, bool] = {}  # env class -> whether it defines a callable ``drive``


def is_self_driven(env: object) -> bool:
    # not isinstance (a Protocol check costs ~µs per episode), and the class's answer cached: a
    # missing attribute costs getattr an exception each time. An instance's own ``drive`` counts too.
    kind = type(env)
    drives = _DRIVES.get(kind)
    if drives is None:
        drives = _DRIVES[kind] = callable(getattr(kind, "drive", None))
    if drives:
        return callable(getattr(env, "drive", None))
    own = getattr(env, "__dict__", None)
    return own is not None and "drive" in own and callable(own["drive"])


class EpisodeOver(EnvError):
    """A turn the episode can no longer take (its turn limit, the model's context is full): the
    env tells its caller so, and the episode ends with ``reason`` once ``drive`` returns."""

    def __init__(self, reason: StopReason, message: str):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # across processes (a rollout worker's agent is told so)
        return type(self), (self.reason, str(self))


class NoTurnsError(EnvError, RuntimeError):
    """A self-driven env returned without sampling a turn: nothing to train (counted, retried)."""


def kept(action: SampledTokens, n: int) -> SampledTokens:
    """The first ``n`` tokens of an action (a prefix the env kept), with their logprobs and versions."""
    if not 0 <= n <= len(action.tokens):
        raise ValueError(f"keep() gave {n}; it must be between 0 and the {len(action.tokens)} tokens sampled")
    if n == len(action.tokens):
        return action
    versions = action.token_versions[:n] if action.token_versions is not None else None
    version = min(versions) if versions else action.policy_version
    if versions is not None and len(set(versions)) <= 1:
        versions = None
    return SampledTokens(action.tokens[:n], action.logprobs[:n], StopReason.STOP, version, versions)


async def drive_episode(env: SelfDrivenEnv, sample, spec: EpisodeSpec, seed: int) -> Trajectory:
    """Run a self-driven env: each turn it asks for is sampled and recorded; ``spec.max_turns``
    turns at most (one more is refused with ``EpisodeOver``), as is a prompt too long for the
    context after the first turn (the first one's is the env's error, as for any env)."""
    transitions: list[Transition] = []
    ended: list[StopReason] = []
    started = 0

    async def policy(prompt: Tokens, stop: StopCondition, keep: Keep | None = None) -> SampledTokens:
        nonlocal started
        turn, started = started, started + 1
        if turn >= spec.max_turns:
            ended.append(StopReason.MAX_TURNS)
            raise EpisodeOver(
                StopReason.MAX_TURNS, f"the episode's turn limit of {spec.max_turns} calls is reached (max_turns)"
            )
        what = "drive() (a turn's prompt)"
        if not isinstance(prompt, list) or not prompt:
            raise _contract(env, what, f"gave {prompt!r:.60} as a prompt", "a prompt is a non-empty list[int]")  # type: ignore[arg-type]
        last = transitions[-1] if transitions else None
        previous = last.observation + last.action.tokens if last else []
        new = prompt[len(previous) :] if previous and prompt[: len(previous)] == previous else prompt
        sampled = (t.action.tokens for t in transitions)  # read only for ids past the vocabulary
        check_tokens(env, what, new, spec.vocab_size, sampled)  # type: ignore[arg-type]
        check_stop(env, "drive() (a turn's stop)", stop, spec.vocab_size)  # type: ignore[arg-type]
        try:
            (action,) = await sample(prompt, 1, params_for(spec, stop, seed * 1000 + turn))
        except PromptTooLongError as e:
            if not transitions:
                raise
            ended.append(StopReason.CONTEXT_OVERFLOW)
            raise EpisodeOver(StopReason.CONTEXT_OVERFLOW, str(e)) from None
        transitions.append(Transition(list(prompt), action, 0.0, False))
        if keep is not None:
            # recorded whole before the env's keep is awaited: a remote env (--cluster ray) lets its
            # agent go on once it has its answer, and the next turn's prompt, which holds these
            # tokens, can arrive before that await returns
            at = len(transitions) - 1
            n = keep(action)
            action = kept(action, await n if inspect.isawaitable(n) else n)
            transitions[at] = Transition(list(prompt), action, 0.0, False)
        return action

    result = await env.drive(policy)
    if not isinstance(result, StepResult):
        raise EnvContractError(
            f"{type(env).__name__}.drive() returned {type(result).__name__}; it must return a headrace.StepResult"
        )
    reward = check_reward(env, "drive()", result.reward)
    metrics = check_metrics(env, "drive()", result.metrics)
    if not transitions:
        raise NoTurnsError(f"{type(env).__name__}.drive() returned without sampling a turn: nothing to train")
    transitions[-1] = dataclasses.replace(transitions[-1], reward=reward, done=True, metrics=metrics)
    return Trajectory(transitions, ended[0] if ended else StopReason.DONE)
