"""A master that refuses its own settings at start tells the workers waiting for it.

A master whose command line or config is refused at start (a missing
--config file, a mistyped key, a bad value, a placement error: any usage
error once the run directory is usable, coordinator_cli/app.py `run`) exits 2 before
run.json exists or is resumed.  Workers started with only `--worker R
--run-dir P` would wait for it until coordination.join_timeout_s.  So:

    master, refused    publishes master-refusal.json (a `Refusal`: a new token,
                       its host, pid, wall time and message), then exits 2
    master, accepted   removes it (runplan.make_plan), before its claim
    worker             while it waits for the master (membership.wait_for_master,
                       runplan._plan_worker): exits 2 with the master's message
                       when the refusal belongs to this launch, and otherwise
                       says in its progress line that the master's last start
                       was refused

    first look ──none──────────────────────────────► wait ──a refusal appears──► exit 2
        │──a refusal published at most WINDOW_S ──► exit 2
        │  before this worker's process started
        └──an older refusal──► wait, saying so ──another token──► exit 2
                                   └──removed (a master started)──► wait

The decision (`WorkerView.judge`) is pure: values in, a verdict out, no files
and no clocks; `watch_worker` does the reads.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import psutil

from coordinator import routing
from coordinator.errors import CoordinatorError, UsageError
from coordinator.machine.claims import hostname
from coordinator.records import layout
from coordinator.records.records import MAX_REFUSAL_CHARS, Refusal
from coordinator.storage.store import FsStore, Store, publish_record, read_record

log = logging.getLogger(__name__)

# A refusal already there at a worker's first look belongs to this launch when the
# master published it at most this long before the worker's process started.  The
# Slurm case: every node starts within a second or so, and the master refuses after
# its imports and its config, seconds later; so the refusal comes after the
# worker's start, or a few seconds before it when the worker's node started late.
# Ordinary clock skew between nodes (NTP or chrony: milliseconds, a loosely kept
# node a second) moves the comparison by far less than the window.  And it is
# short enough that a refusal the user has since fixed is older: reading the
# error, fixing the command and starting every node again takes longer, and the
# fixed master removes the refusal as it starts.  A worker started later than
# this after a refusal keeps waiting, and its progress line says the master's
# last start was refused.
WINDOW_S: Final = 10.0
# A torn or stale read of the refusal is read again for this long; past it the
# look decides nothing, and the next poll reads it again.
READ_RETRY_S: Final = 1.0
# Of a message read from the run directory (untrusted), what a worker prints.
SHOWN_CHARS: Final = 1000


def refuse(run_dir: Path, message: str) -> None:
    """Master: publish that its settings were refused (never raises: the master's own
    exit 2 and message matter more than telling the workers)."""
    record = Refusal(token=secrets.token_hex(8), host=hostname()[:255], pid=os.getpid(),
                     wall_time=time.time(), message=message[:MAX_REFUSAL_CHARS])
    try:
        publish_record(FsStore(run_dir), layout.MASTER_REFUSAL, record)
    except (OSError, CoordinatorError) as exc:
        log.warning("could not tell the workers that this master was refused (%s/%s): %s",
                    routing.display(run_dir), layout.MASTER_REFUSAL, exc)


def clear(store: Store, run_dir: Path) -> None:
    """Master, its settings accepted: an earlier refusal no longer stands."""
    try:
        if store.remove(layout.MASTER_REFUSAL):
            log.info("removed %s/%s: the master's last start was refused, this one was not",
                     routing.display(run_dir), layout.MASTER_REFUSAL)
    except (OSError, CoordinatorError) as exc:
        # Workers started with this master judge the old refusal by its age (WINDOW_S).
        log.warning("could not remove %s/%s, left by a refused master: %s",
                    routing.display(run_dir), layout.MASTER_REFUSAL, exc)


class Verdict(str, enum.Enum):
    """What a worker waiting for the master does about a refusal."""

    WAIT = "wait"  # none: the usual wait
    EARLIER = "earlier"  # an earlier start's (since fixed?): wait, and say so
    REFUSED = "refused"  # this launch's master refused its settings: exit 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerView:
    """What a worker saw of master-refusal.json at its first look."""

    first: str | None  # the refusal's token then (None: there was none)

    @staticmethod
    def judge(view: WorkerView | None, refusal: Refusal | None, *, started: float,
              window_s: float = WINDOW_S) -> tuple[WorkerView, Verdict]:
        """The next view and the verdict, from one look (`refusal`, None when absent);
        `started`: the worker process's start on its own wall clock."""
        if view is None:
            view = WorkerView(first=refusal.token if refusal is not None else None)
            if refusal is None:
                return view, Verdict.WAIT
            if refusal.wall_time >= started - window_s:
                return view, Verdict.REFUSED
            return view, Verdict.EARLIER
        if refusal is None:
            return view, Verdict.WAIT
        if refusal.token != view.first:
            return view, Verdict.REFUSED
        return view, Verdict.EARLIER


def shown(text: str) -> str:
    """An untrusted message as a worker prints it: bounded, one line, printable."""
    clipped = text[:SHOWN_CHARS] + (" [...]" if len(text) > SHOWN_CHARS else "")
    return "".join(c if c.isprintable() else " " if c in "\n\t" else "?" for c in clipped)


def age(seconds: float) -> str:
    if seconds < 1:
        return "just now"  # or a clock ahead of this node's
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.0f} h ago"


def refused_message(refusal: Refusal, *, now: float) -> str:
    return (f"the master (pid {refusal.pid} on {shown(refusal.host)}) refused its settings "
            f"{age(now - refusal.wall_time)}, so this run cannot start: "
            f"{shown(refusal.message)} -- fix the master's command line or config and start "
            "every node again (workers need only --worker R --run-dir P)")


def earlier_note(refusal: Refusal, *, now: float) -> str:
    return (f"; the master's last start, {age(now - refusal.wall_time)} on "
            f"{shown(refusal.host)}, was refused: {shown(refusal.message)}")


def process_start() -> float:
    """This process's start on the wall clock (before its imports and its config)."""
    try:
        return float(psutil.Process().create_time())
    except (psutil.Error, OSError):
        return time.time()


@dataclasses.dataclass
class Watch:
    """A worker's watch of master-refusal.json: `check` for the wait for the master
    (raises UsageError, exit 2), `note` for its progress line."""

    store: Store
    started: float
    wall: Callable[[], float] = time.time
    retry_s: float = READ_RETRY_S
    view: WorkerView | None = None
    earlier: Refusal | None = None
    unreadable: str = ""

    def check(self) -> None:
        try:
            refusal = read_record(self.store, layout.MASTER_REFUSAL, Refusal,
                                  retry_s=self.retry_s)
        except (OSError, CoordinatorError) as exc:
            # Torn, foreign or hostile: never trusted, and no look at all (a refusal
            # judged later by its token or age is judged the same).
            if str(exc) != self.unreadable:
                log.warning("ignoring %s: %s", layout.MASTER_REFUSAL, exc)
                self.unreadable = str(exc)
            return
        self.unreadable = ""
        self.view, verdict = WorkerView.judge(self.view, refusal, started=self.started)
        self.earlier = refusal if verdict is Verdict.EARLIER else None
        if verdict is Verdict.REFUSED:
            assert refusal is not None
            raise UsageError(refused_message(refusal, now=self.wall()))

    def note(self) -> str:
        return earlier_note(self.earlier, now=self.wall()) if self.earlier else ""


def watch_worker(store: Store, *, started: float | None = None) -> Watch:
    return Watch(store=store, started=process_start() if started is None else started)
