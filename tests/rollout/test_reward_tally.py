"""Reward calls that ran out of time: counted per rollout, and loud past 1 % of an
iteration's calls (rollout/reward_tally.py; the WARNING is phase 4's and 6's)."""

from __future__ import annotations

import logging
import threading

import pytest

from rollout.accumulator import AggregateMetrics
from rollout.reward_tally import RewardTally, count_call, tallying, timeout_warning


def test_a_tally_counts_the_calls_of_its_own_context_only() -> None:
    count_call(timed_out=True)  # no rollout counting here: nowhere
    with tallying(RewardTally()) as outer:
        count_call(timed_out=False)
        with tallying(RewardTally()) as inner:
            count_call(timed_out=True)
        count_call(timed_out=True)
        # A plain thread starts in an empty context: its calls are not this rollout's
        # unless started in a copy of it (rollout/agents.py does).
        stray = threading.Thread(target=count_call, kwargs={"timed_out": True})
        stray.start()
        stray.join()
    assert outer.counts() == (2, 1) and inner.counts() == (1, 1)


def test_more_than_one_percent_of_the_calls_timing_out_is_a_warning_naming_the_counts() -> None:
    assert timeout_warning(calls=1000, timeouts=10, iteration=3, split="train") is None
    assert timeout_warning(calls=0, timeouts=0, iteration=3, split="train") is None
    line = timeout_warning(calls=1000, timeouts=11, iteration=3, split="train")
    assert line is not None and line.startswith(
        "iteration 3: 11 of 1000 train reward calls (1.1%, more than 1%) ran out of time and "
        "scored 0 whatever the answer")


@pytest.mark.parametrize(("timeouts", "loud"), [(1, False), (2, True)])
def test_phase_4_logs_the_warning_past_the_share(caplog: pytest.LogCaptureFixture,
                                                 timeouts: int, loud: bool) -> None:
    from rl.aggregation import warn_reward_timeouts

    metrics = AggregateMetrics(iteration=5, num_tasks=16, num_samples=128, num_failed=0,
                               reward_mean=0.5, reward_std=0.5, accuracy=0.5,
                               response_length_mean=3.0, response_length_max=6,
                               reward_calls=128, reward_timeouts=timeouts)
    with caplog.at_level(logging.WARNING):
        warn_reward_timeouts(5, "train", metrics)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warned) is loud
    if loud:
        assert "iteration 5: 2 of 128 train reward calls (1.6%" in warned[0].getMessage()
