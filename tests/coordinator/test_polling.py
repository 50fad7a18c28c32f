"""Waits back off to a ceiling, report what they wait for, and honour deadlines."""

from __future__ import annotations

import logging
import threading

import pytest

from coordinator.errors import WaitTimeout
from coordinator.machine.polling import Backoff, Clock, Wait


class FakeClock(Clock):
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float, wake: threading.Event | None = None) -> None:
        self.sleeps.append(seconds)
        self.t += seconds


BACKOFF = Backoff(initial_s=0.01, factor=2.0, ceiling_s=1.0)


def test_polls_start_fast_and_back_off_to_the_ceiling() -> None:
    clock = FakeClock()
    results = iter([None] * 10 + ["done"])
    wait = Wait(deadline_s=100, backoff=BACKOFF, progress_interval_s=10,
                describe=lambda: "x", clock=clock)
    assert wait.until(lambda: next(results)) == "done"
    assert clock.sleeps[:4] == [0.01, 0.02, 0.04, 0.08]
    assert max(clock.sleeps) == 1.0 and clock.sleeps[-1] == 1.0
    assert wait.polls == 11


def test_a_wait_reports_what_it_waits_for_at_most_once_per_interval(caplog) -> None:
    clock = FakeClock()
    caplog.set_level(logging.INFO, logger="coordinator.machine.polling")
    wait = Wait(deadline_s=30.5, backoff=BACKOFF, progress_interval_s=10,
                describe=lambda: "rank 2 at phase 3", clock=clock)
    with pytest.raises(WaitTimeout, match="gave up after 30 s waiting for rank 2 at phase 3"):
        wait.until(lambda: None)
    reports = [r for r in caplog.records if "rank 2 at phase 3" in r.getMessage()]
    # first report after 1 s, then every 10 s: at about 1, 11, 21 s
    assert 3 <= len(reports) <= 4


def test_a_failure_check_interrupts_the_wait() -> None:
    clock = FakeClock()

    def check() -> None:
        if clock.t > 0.5:
            raise RuntimeError("peer lost")

    wait = Wait(deadline_s=100, backoff=BACKOFF, progress_interval_s=10,
                describe=lambda: "x", clock=clock, check=check)
    with pytest.raises(RuntimeError, match="peer lost"):
        wait.until(lambda: None)
    assert clock.t < 2.0
