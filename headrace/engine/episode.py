"""One episode: prompt → sample → step …, until the env says done or the turn limit."""

from __future__ import annotations

from dataclasses import dataclass

from headrace.engine.types import (
    Env,
    SampledTokens,
    SamplingParams,
    StepResult,
    StopCondition,
    StopReason,
    Tokens,
    Trajectory,
    Transition,
)


class EnvContractError(TypeError):
    """An env broke its contract (wrong types, no observation). A bug, never retried."""


class PromptTooLongError(ValueError):
    """A prompt that leaves no room in the model's context. Deterministic, never retried."""

    def __init__(self, prompt_tokens: int, max_context: int):
        super().__init__(
            f"a prompt of {prompt_tokens} tokens does not fit the model's context of {max_context} tokens; "
            "shorten the env's prompts or use a model with a longer context"
        )


@dataclass(frozen=True)
class EpisodeSpec:
    """What every episode of a run shares: the sampling knobs and the turn limit."""

    base_params: SamplingParams
    max_turns: int
    seed: int


def check_observation(env: Env, value: object) -> tuple[Tokens, StopCondition]:
    if (
        not isinstance(value, tuple)
        or len(value) != 2
        or not isinstance(value[0], list)
        or not isinstance(value[1], StopCondition)
    ):
        got = (
            f"({', '.join(type(v).__name__ for v in value)})" if isinstance(value, tuple) else type(value).__name__
        )
        raise EnvContractError(
            f"{type(env).__name__}.initial_observation() returned {got}; it must return "
            "(prompt_tokens: list[int], StopCondition)"
        )
    if not value[0]:
        raise EnvContractError(f"{type(env).__name__}.initial_observation() returned an empty prompt")
    return value


def check_step(env: Env, value: object) -> StepResult:
    if not isinstance(value, StepResult):
        raise EnvContractError(
            f"{type(env).__name__}.step() returned {type(value).__name__}; it must return a headrace.StepResult"
        )
    if not value.done and not value.next_observation:
        raise EnvContractError(
            f"{type(env).__name__}.step() returned done=False with no next_observation; "
            "a multi-turn env must give the next prompt"
        )
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
    first: tuple[Tokens, StopCondition, SampledTokens] | None = None,
) -> Trajectory:
    """Drive one env to the end. ``first`` carries a prompt and an action sampled for the whole
    group at once (one ``n=G`` call when the group shares its prompt)."""
    if first is not None:
        observation, stop, action = first
    else:
        observation, stop = check_observation(env, await env.initial_observation())
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
        result = check_step(env, await env.step(action))
        transitions.append(Transition(observation, action, result.reward, result.done, result.metrics))
        if result.done:
            return Trajectory(transitions, StopReason.DONE)
        observation, stop, action = result.next_observation, result.next_stop or stop, None
    return Trajectory(transitions, StopReason.MAX_TURNS)
