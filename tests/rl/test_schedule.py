"""The RL loop's schedule: which phases run and when to evaluate (rl/schedule.py)."""

from __future__ import annotations

import pytest

from coordinator.errors import UsageError
from coordinator.machine.actions import kind, resolve_config
from coordinator.records.phases import PHASES, Phase
from rl.schedule import RlPhase, RolloutSplit, ScheduleSection


def test_rl_phase_selects_the_halves_of_the_loop() -> None:
    assert RlPhase.ROLLOUT.phases == tuple(Phase(p) for p in range(7))
    assert RlPhase.UPDATE.phases == tuple(Phase(p) for p in range(7, 14))
    assert len(RlPhase.BOTH.phases) == 14 == len(PHASES)


def test_the_phase_machine_learns_the_phases_from_the_action_kind() -> None:
    rollout_only = resolve_config({"schedule": {"rl_phase": "rollout"}})
    assert kind("rl").phases_of(rollout_only) == RlPhase.ROLLOUT.phases
    assert kind("rl").phases_of(resolve_config({})) == tuple(Phase)
    # The scripted kind has no schedule: every phase.
    assert kind("scripted").phases_of(resolve_config({"run": {"actions": "scripted"}})) \
        == tuple(Phase)


def evaluates(iterations: int, **schedule: object) -> list[bool]:
    s = ScheduleSection(**schedule)  # type: ignore[arg-type]
    return [s.evaluates(i) for i in range(iterations)]


def test_eval_interval_one_evaluates_every_iteration_unlike_the_anchor() -> None:
    assert evaluates(4, eval_interval=1, eval_before_train=False) == [False, True, True, True]
    assert evaluates(3, eval_interval=1, eval_before_train=True) == [True, True, True]
    assert evaluates(7, eval_interval=3, eval_before_train=False) == [
        False, False, False, True, False, False, True]
    assert not any(evaluates(6, eval_interval=0, eval_before_train=True))


def test_the_rollout_split_overrides_the_interval() -> None:
    assert not any(evaluates(4, eval_interval=1, rollout_split=RolloutSplit.TRAIN_ONLY))
    assert all(evaluates(4, eval_interval=0, eval_before_train=False,
                         rollout_split=RolloutSplit.EVAL_ONLY))
    assert not ScheduleSection(rollout_split=RolloutSplit.EVAL_ONLY).trains


def test_a_negative_interval_is_refused_naming_the_key() -> None:
    with pytest.raises(UsageError, match=r"schedule.eval_interval=-1 is negative"):
        resolve_config({"schedule": {"eval_interval": -1}})
