"""Waiting with a deadline, adaptive polling, optional wake-ups and a voice.

A `Wait` polls a probe fast at first and backs off to a ceiling, so a barrier
that releases at once costs milliseconds while a barrier that waits an hour
costs one read per ceiling interval.  On a local filesystem a
`coordinator.storage.waker.Waker` (inotify) cuts a sleep short when a watched file is
renamed into place; on NFS no event ever arrives from another client and the
poll alone decides, so correctness never depends on the events.

Every wait says what it waits for when it starts and then at most once per
progress interval, and its timeout error carries the same words.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from coordinator.errors import WaitTimeout

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Backoff:
    initial_s: float
    factor: float
    ceiling_s: float

    def intervals(self) -> Iterator[float]:
        interval = self.initial_s
        while True:
            yield interval
            interval = min(self.ceiling_s, interval * self.factor)


class Clock:
    """Monotonic time and sleeping, injectable so backoff tests run instantly."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float, wake: threading.Event | None = None) -> bool:
        """Sleep; True when `wake` cut the sleep short."""
        if wake is None:
            time.sleep(seconds)
            return False
        if wake.wait(seconds):
            wake.clear()
            return True
        return False


class Wait:
    """One wait: `until(probe)` returns the probe's first non-None result."""

    def __init__(
        self,
        *,
        deadline_s: float,
        backoff: Backoff,
        progress_interval_s: float,
        describe: Callable[[], str],
        clock: Clock | None = None,
        wake: threading.Event | None = None,
        check: Callable[[], None] | None = None,
        on_progress: Callable[[str], None] | None = None,
        logger: logging.Logger = log,
    ) -> None:
        self.deadline_s = deadline_s
        self.backoff = backoff
        self.progress_interval_s = progress_interval_s
        self.describe = describe
        self.clock = clock or Clock()
        self.wake = wake
        self.check = check
        self.on_progress = on_progress
        self.logger = logger
        self.polls = 0
        self.woken = False  # the last sleep ended on a file-change event, not its timer

    def until(self, probe: Callable[[], T | None]) -> T:
        clock = self.clock
        start = clock.now()
        deadline = start + self.deadline_s
        # The start goes to the debug log (and, through on_progress, into the
        # heartbeat that `status` shows); the info log speaks once a wait has
        # lasted a second, so fast barriers do not flood it.
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug("waiting for %s", self.describe())
        next_report = start + min(1.0, self.progress_interval_s)
        for interval in self.backoff.intervals():
            if self.check is not None:
                self.check()
            self.polls += 1
            result = probe()
            if result is not None:
                return result
            now = clock.now()
            if now >= next_report:
                text = self.describe()
                waited = now - start
                self.logger.info("waiting for %s (%.0f s so far)", text, waited)
                if self.on_progress is not None:
                    self.on_progress(text)
                next_report = now + self.progress_interval_s
            if now >= deadline:
                raise WaitTimeout(
                    f"gave up after {self.deadline_s:.0f} s waiting for {self.describe()}"
                )
            self.woken = bool(clock.sleep(min(interval, max(0.0, deadline - now)), self.wake))
        raise AssertionError("unreachable: Backoff.intervals is infinite")
