"""What a rollout may lose: the failed-sample budget and the smallest batch trained on."""

from __future__ import annotations

import pytest

from rollout.budget import check_batch, check_failures
from rollout.errors import BudgetError


def test_the_phase_fails_only_past_the_failed_fraction_naming_the_first_failure() -> None:
    first = "task t/1: the agent raised ValueError: boom"
    check_failures(2, samples=20, fraction=0.1, where="train", first=first)  # at the limit
    with pytest.raises(BudgetError, match=r"2 of 19 train samples failed \(limit "
                       r"rollout.max_failed_fraction=0.1\); first: task t/1: the agent raised"
                       ) as info:
        check_failures(2, samples=19, fraction=0.1, where="train", first=first)
    assert info.value.setting == "rollout.max_failed_fraction" and info.value.limit == 0.1
    check_failures(0, samples=0, fraction=0.0, where="eval")


def test_a_batch_is_refused_when_empty_or_below_the_minimum_fraction() -> None:
    check_batch(512, rolled_out=1024, fraction=0.5, iteration=3)
    with pytest.raises(BudgetError, match=r"iteration 3 would hold 511 of the 1024 samples "
                       r"rolled out \(50%; rollout.min_batch_fraction=0.5\).*scraps"):
        check_batch(511, rolled_out=1024, fraction=0.5, iteration=3)
    # Empty is refused whatever the fraction says.
    with pytest.raises(BudgetError, match=r"an empty batch is never trained on.*nothing"):
        check_batch(0, rolled_out=1024, fraction=0.0, iteration=0)
    with pytest.raises(BudgetError, match="0 of the 0 samples"):
        check_batch(0, rolled_out=0, fraction=0.0, iteration=0)
