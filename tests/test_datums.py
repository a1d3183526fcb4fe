"""Advantages and datum assembly on hand-checked cases."""

from __future__ import annotations

import pytest

from headrace.core.advantages import group_advantages, is_constant
from headrace.core.datums import trajectory_to_datums
from headrace.core.types import SampledTokens, StopReason, Trajectory, Transition


def act(tokens, logprobs, version=0):
    return SampledTokens(tokens, logprobs, StopReason.STOP, policy_version=version)


def test_group_centred_advantages():
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    normed = group_advantages([1.0, 0.0, 0.0, 1.0], normalize_std=True)
    assert normed == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert is_constant([0.3, 0.3, 0.3]) and not is_constant([0.3, 0.4])


def test_multi_turn_observations_that_extend_merge_into_one_masked_datum():
    traj = Trajectory(
        [
            Transition([1, 2], act([3, 4], [-0.1, -0.2], version=3), 0.0, False),
            Transition([1, 2, 3, 4, 5], act([6], [-0.3], version=2), 1.0, True),
        ],
        StopReason.DONE,
    )
    (datum,) = trajectory_to_datums(traj, advantage=0.5)
    assert datum.model_input == [1, 2, 3, 4, 5]
    assert datum.target_tokens == [2, 3, 4, 5, 6]
    assert datum.mask == [0, 1, 1, 0, 1]
    assert datum.logprobs == [0.0, -0.1, -0.2, 0.0, -0.3]
    assert datum.advantages == [0.0, 0.5, 0.5, 0.0, 0.5]
    assert datum.policy_version == 2  # the oldest token's version


def test_a_prefix_break_starts_a_new_datum():
    traj = Trajectory(
        [
            Transition([1, 2], act([3], [-0.1]), 0.0, False),
            Transition([9, 8], act([7, 6], [-0.5, -0.6]), 1.0, True),  # context was rewritten
        ],
        StopReason.DONE,
    )
    first, second = trajectory_to_datums(traj, advantage=-1.0)
    assert (first.model_input, first.target_tokens, first.mask) == ([1, 2], [2, 3], [0, 1])
    assert first.advantages == [0.0, -1.0]
    assert (second.model_input, second.target_tokens, second.mask) == ([9, 8, 7], [8, 7, 6], [0, 1, 1])
    assert second.logprobs == [0.0, -0.5, -0.6]


def test_an_empty_action_gives_no_datum():
    traj = Trajectory([Transition([1, 2], act([], []), 0.0, True)], StopReason.DONE)
    assert trajectory_to_datums(traj, 1.0) == []


@pytest.mark.parametrize("prompt", [[], [5], [1, 2, 3]])
@pytest.mark.parametrize("action", [[], [7], [7, 8, 9]])
def test_a_single_turn_datum_is_the_one_the_general_assembly_makes(prompt, action):
    from headrace.core.datums import _by_sequence

    logprobs = [-0.5 - i for i in range(len(action))]
    traj = Trajectory([Transition(prompt, act(action, logprobs, version=4), 1.0, True)], StopReason.DONE)
    assert trajectory_to_datums(traj, 0.25) == _by_sequence(traj, 0.25)
