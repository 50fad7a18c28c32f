"""What a rollout may lose: the failed-sample budget and the smallest batch trained on."""

from __future__ import annotations

import pytest

from rollout.budget import (
    allowed_failures,
    check_batch,
    check_failures,
    check_failures_so_far,
)
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


@pytest.mark.parametrize(("planned", "fraction"), [(1024, 0.1), (1000, 0.1), (19, 0.1), (7, 0.3),
                                                   (10, 0.0), (10, 1.0), (3, 0.7)])
def test_the_budget_allows_exactly_the_failures_the_final_check_passes(
        planned: int, fraction: float) -> None:
    allowed = allowed_failures(planned, fraction)
    check_failures(allowed, samples=planned, fraction=fraction, where="train")
    if allowed < planned:
        with pytest.raises(BudgetError):
            check_failures(allowed + 1, samples=planned, fraction=fraction, where="train")


def test_a_phase_stops_as_soon_as_its_failures_pass_the_whole_phase_budget() -> None:
    first = "task t/61: the episode ran past rollout.episode_timeout_s=5 s and was abandoned"
    # 1,024 planned at 10 %: 102 may fail, however early they come.
    check_failures_so_far(102, seen=102, planned=1024, fraction=0.1, where="train", first=first)
    with pytest.raises(BudgetError, match=(
            r"^103 of the first 104 train samples failed: rollout.max_failed_fraction=0.1 "
            r"allows 102 of the phase's 1024, so it stops now instead of going through the "
            r"other 920; first: task t/61: the episode ran past")) as info:
        check_failures_so_far(103, seen=104, planned=1024, fraction=0.1, where="train",
                              first=first)
    assert info.value.setting == "rollout.max_failed_fraction" and info.value.limit == 0.1
    # All seen: the final check gives the verdict (and its message), not this one.
    check_failures_so_far(500, seen=1024, planned=1024, fraction=0.1, where="train")
