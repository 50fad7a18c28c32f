"""Pure rules of the phase machine."""

from __future__ import annotations

from coordinator.phases import PHASES, Phase, RlPhase, RolloutSplit, should_eval


def test_rl_phase_selects_the_halves_of_the_loop() -> None:
    assert RlPhase.ROLLOUT.phases == tuple(Phase(p) for p in range(7))
    assert RlPhase.UPDATE.phases == tuple(Phase(p) for p in range(7, 14))
    assert len(RlPhase.BOTH.phases) == 14 == len(PHASES)


def test_eval_interval_one_evaluates_every_iteration_unlike_the_anchor() -> None:
    both = RolloutSplit.BOTH
    assert [should_eval(i, eval_interval=1, eval_before_train=False, split=both)
            for i in range(4)] == [False, True, True, True]
    assert [should_eval(i, eval_interval=1, eval_before_train=True, split=both)
            for i in range(3)] == [True, True, True]
    assert [should_eval(i, eval_interval=3, eval_before_train=False, split=both)
            for i in range(7)] == [False, False, False, True, False, False, True]
    assert not should_eval(5, eval_interval=0, eval_before_train=True, split=both)


def test_the_rollout_split_overrides_the_interval() -> None:
    assert not should_eval(3, eval_interval=1, eval_before_train=True,
                           split=RolloutSplit.TRAIN_ONLY)
    assert should_eval(1, eval_interval=0, eval_before_train=False, split=RolloutSplit.EVAL_ONLY)
