"""A rank's phase journal: which actions it completed, so a restart never redoes them.

`ranks/<R>/journal.json` (docs/PROTOCOL.md) is written by rank R only, after
each completed action and each completed iteration.  A restarted daemon
reads it back and resumes at the first iteration not completed, skipping
the actions it already lists.
"""

from __future__ import annotations

import logging

from coordinator.errors import CoordinatorError
from coordinator.records import layout
from coordinator.records.phases import Phase
from coordinator.records.records import Journal
from coordinator.storage.store import Store, publish_record, read_record

log = logging.getLogger(__name__)


class JournalBook:
    """This rank's journal: read once at start, published at every change."""

    def __init__(self, store: Store, *, run_id: str, rank: int, retry_s: float) -> None:
        self.store = store
        self.rank = rank
        self.record = self._load(run_id, retry_s)

    def _load(self, run_id: str, retry_s: float) -> Journal:
        fresh = Journal(run_id=run_id, rank=self.rank, completed_iteration=-1, iteration=0,
                        done=())
        try:
            journal = read_record(self.store, layout.journal(self.rank), Journal,
                                  retry_s=retry_s)
        except CoordinatorError as exc:
            # Worse than none: every action then runs again (idempotently).
            log.warning("ignoring an unreadable journal: %s", exc)
            return fresh
        if journal is None or journal.run_id != run_id or journal.rank != self.rank:
            return fresh
        log.info("rank %d resumes from its journal: iterations up to %d complete, iteration %d "
                 "phases %s done", self.rank, journal.completed_iteration, journal.iteration,
                 list(journal.done))
        return journal

    @property
    def resume_iteration(self) -> int:
        return self.record.resume_iteration

    def is_done(self, iteration: int, phase: Phase) -> bool:
        return self.record.is_done(iteration, phase)

    def done_phases(self, iteration: int) -> tuple[int, ...]:
        return tuple(int(p) for p in Phase if self.record.is_done(iteration, p))

    def mark_done(self, iteration: int, phase: Phase) -> None:
        self.record = self.record.with_done(iteration, int(phase))
        self._publish()

    def complete(self, iteration: int) -> None:
        self.record = self.record.with_completed(iteration)
        self._publish()

    def skip_to(self, iteration: int) -> None:
        """The group completed the iterations before `iteration` without this rank
        (it went on without it: on_failure "shrink"): start there, never go back."""
        if self.record.resume_iteration >= iteration:
            return
        log.warning("rank %d rejoins the group at iteration %d: iterations %d..%d were "
                    "completed by the others without it", self.rank, iteration,
                    self.record.resume_iteration, iteration - 1)
        self.record = self.record.with_completed(iteration - 1)
        self._publish()

    def _publish(self) -> None:
        publish_record(self.store, layout.journal(self.rank), self.record)
