"""The inflight scheduler's ledger on its own, driven by hand (no tasks, no clock): the admission
bound, earliest-deadline-first steps, a step held for a running group that is due, and the
restart of an overdue one."""

from __future__ import annotations

import pytest

from headrace.core.admission import InflightLedger
from headrace.core.advantage_actor import ProcessedGroup
from headrace.core.types import GroupKey

pytestmark = pytest.mark.timeout(10)


def finished(batch: int, index: int) -> ProcessedGroup:
    return ProcessedGroup(GroupKey(batch, index), -1, 0, [], "trained", policy_version=0)


def admit_all(ledger: InflightLedger, version: int, keys: list[GroupKey]) -> list[GroupKey]:
    """Admit ``keys`` in order while the bound allows; the ones admitted."""
    taken = []
    for key in keys:
        if not ledger.can_admit(version):
            break
        ledger.admit(key, version)
        taken.append(key)
    return taken


def test_admission_keeps_the_groups_not_given_a_step_within_the_slots_up_to_the_deadline():
    # B = 2, m = 1, version 0, step 0: (2 - 0) + (0 + 1 - 0) * 2 = 4 slots
    ledger = InflightLedger(range(5), max_steps_off_policy=1, batch_size=2)
    keys = [GroupKey(b, i) for b in range(3) for i in range(2)]
    assert admit_all(ledger, 0, keys) == keys[:4]
    assert ledger.outstanding == dict.fromkeys(keys[:4], 1)  # deadline: version + m
    # finishing or being given a step frees no slot: the group holds one of its step's
    ledger.arrive(finished(0, 1))
    assert not ledger.can_admit(0)
    group = ledger.commit()
    assert group is not None and group.step == 0 and group.batch_size == 2 and group.key == GroupKey(0, 1)
    assert not ledger.can_admit(0)
    # a new version opens a step's worth of slots
    assert admit_all(ledger, 1, keys[4:]) == keys[4:]
    assert ledger.outstanding[keys[4]] == 2


def test_finished_groups_go_to_steps_earliest_deadline_first_keeping_their_dataset_key():
    ledger = InflightLedger(range(3), max_steps_off_policy=2, batch_size=2)
    old = [GroupKey(0, 0), GroupKey(0, 1)]
    new = [GroupKey(1, 0), GroupKey(1, 1)]
    assert admit_all(ledger, 0, old) == old  # deadline 2
    assert admit_all(ledger, 1, new) == new  # deadline 3
    for key in (new[1], old[1], new[0], old[0]):  # the newer ones finish first
        ledger.arrive(finished(key.batch, key.index))
    committed = [ledger.commit() for _ in range(4)]
    assert all(g is not None for g in committed)
    assert [(g.key, g.step) for g in committed if g] == [(old[1], 0), (old[0], 0), (new[1], 1), (new[0], 1)]
    assert ledger.commit() is None and ledger.step == 2 and ledger.waiting == 0
    assert not ledger.done
    ledger.admit(GroupKey(2, 0), 2)
    ledger.arrive(finished(2, 0))
    ledger.admit(GroupKey(2, 1), 2)
    ledger.arrive(finished(2, 1))
    assert ledger.commit() is not None and ledger.commit() is not None and ledger.done


def test_a_step_is_held_for_running_groups_that_are_due_and_an_overdue_one_can_be_restarted():
    ledger = InflightLedger(range(4), max_steps_off_policy=1, batch_size=1)
    due = [GroupKey(0, 0), GroupKey(1, 0)]
    assert admit_all(ledger, 0, [*due, GroupKey(2, 0)]) == due  # deadline 1 each; 2 slots
    late = GroupKey(2, 0)
    assert admit_all(ledger, 1, [late]) == [late]  # deadline 2
    ledger.arrive(finished(2, 0))
    # committing it to step 0 would leave one slot (step 1) for the two groups due by step 1
    assert ledger.commit() is None and ledger.waiting == 1
    # the learner has trained every step before the one being filled: restart the earliest due
    assert ledger.overdue(version=1) == due[0]
    ledger.restarted(due[0], version=1)
    assert ledger.outstanding[due[0]] == 2 and ledger.regenerated == 1
    group = ledger.commit()  # now only one group is due by step 1: step 0 may take the finished one
    assert group is not None and group.key == late and group.step == 0
    # nothing to restart while the learner is behind the step being filled (now 1)...
    assert ledger.step == 1 and ledger.overdue(version=0) is None
    # ...or when the earliest deadline is what a restart would give anyway
    assert ledger.overdue(version=1) == due[1]
    ledger.restarted(due[1], version=1)
    assert ledger.overdue(version=1) is None
