"""A finished run stays finished: a daemon started again on one exits 0 at once.

A run is finished when the master's journal (`ranks/0/journal.json`) has
completed `run.iterations`: the master completes an iteration only once every
member arrived at its last phase, so no rank has work left (a rank a shrunk
group went on without included: the others did its share).

    master  its own journal completed the iterations it was given: it exits 0
            before waiting for anyone, saying so.  A raised --iterations is not
            finished: the run goes on (the master republishes run.json with the
            new count before its first heartbeat).
    worker  while it waits for a master: run.json's iterations all completed by
            the master's journal.  It exits 0 as soon as rank 0's heartbeat
            says `finished` for a master other than one seen finished at the
            first look (the master, restarted with the same command, found the
            run complete: a requeue of every node), or once rank 0's heartbeat
            has not changed for a lease (nobody restarts the master: started
            alone).  A master restarted to extend the run republishes run.json
            first: the run is no longer finished, and the worker joins it.

    first look ──finished──► watching ──rank 0 finished, a new master──► exit 0
        │                       │──── no change in rank 0's beat for a lease ──► exit 0
        └──not finished──► the usual wait   ◄──run.json raised (not finished)──┘

The decision (`WorkerWatch.judge`) is pure: values in, a verdict out, time
injected; `watch_worker` does the reads.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable

from coordinator.config.run_config import RunConfig
from coordinator.errors import CoordinatorError, RunCompleted
from coordinator.machine.actions import kind_of
from coordinator.machine.polling import Clock
from coordinator.records import layout
from coordinator.records.records import Heartbeat, Journal, Manifest, NodeState
from coordinator.storage.store import Store, read_record

log = logging.getLogger(__name__)


def complete(resume_iteration: int, iterations: int) -> bool:
    """Whether a journal that resumes at `resume_iteration` completed a run of
    `iterations` (the master's journal: the run's own progress)."""
    return resume_iteration >= iterations


def master_message(run_id: str, iterations: int) -> str:
    return (f"run {run_id} is already complete: the master's journal (ranks/0/journal.json) "
            f"completed its {iterations} iterations, so there is nothing to do; to train on, "
            "start the master with a higher --iterations (the workers with their usual "
            "commands), or start a new run with --new-run")


class Verdict(str, enum.Enum):
    """What a worker waiting for a master does about a finished run."""

    WAIT = "wait"  # not finished, or a master may still show up: the usual wait
    FINISHED = "finished"  # exit 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerWatch:
    """A worker's view of rank 0 while the run looks finished."""

    first_finished: str | None  # the token of a `finished` heartbeat at the first look
    last: tuple[str, int] | None  # rank 0's (token, counter) last seen
    since: float  # on this worker's monotonic clock: when `last` was first seen

    @staticmethod
    def judge(watch: WorkerWatch | None, *, finished: bool, master: Heartbeat | None,
              now: float, grace_s: float) -> tuple[WorkerWatch | None, Verdict]:
        """The next watch and the verdict, from one look at run.json, the master's
        journal (`finished`) and rank 0's heartbeat (`master`, None when absent)."""
        if not finished:
            return None, Verdict.WAIT
        seen = (master.token, master.counter) if master is not None else None
        done = master is not None and master.state is NodeState.FINISHED
        if watch is None:
            return WorkerWatch(first_finished=master.token if master and done else None,
                               last=seen, since=now), Verdict.WAIT
        if master is not None and done and master.token != watch.first_finished:
            return watch, Verdict.FINISHED
        if seen != watch.last:
            return dataclasses.replace(watch, last=seen, since=now), Verdict.WAIT
        return watch, Verdict.FINISHED if now - watch.since >= grace_s else Verdict.WAIT


def worker_message(run_id: str, iterations: int, rank: int) -> str:
    return (f"run {run_id} is already complete: the master's journal (ranks/0/journal.json) "
            f"completed its {iterations} iterations and no master is running it, so rank "
            f"{rank} has nothing to do; to train on, start the master with a higher "
            "--iterations first, then this worker")


def watch_worker(store: Store, *, rank: int, retry_s: float,
                 clock: Clock | None = None) -> Callable[[], None]:
    """A `check` for the worker's wait for a master: raises RunCompleted (exit 0)
    once the run is finished and no master will go on with it (WorkerWatch)."""
    clock = clock or Clock()
    state: dict[str, WorkerWatch | None] = {"watch": None}

    def check() -> None:
        try:
            manifest = read_record(store, layout.MANIFEST, Manifest, retry_s=retry_s)
            if manifest is None:
                state["watch"] = None
                return
            config = RunConfig.from_dict(manifest.config, kind_of(manifest.config).run_section)
            journal = read_record(store, layout.journal(0), Journal, retry_s=retry_s)
            master = read_record(store, layout.heartbeat(0), Heartbeat, retry_s=retry_s)
        except CoordinatorError as exc:
            # Torn, foreign or unparsable: decide nothing from it (the wait
            # itself reports a run.json that stays unusable).
            log.debug("cannot tell whether the run is finished: %s", exc)
            return
        run_id = manifest.run_id
        finished = journal is not None and journal.run_id == run_id and complete(
            journal.resume_iteration, config.run.iterations)
        ours = master if master is not None and master.run_id == run_id else None
        state["watch"], verdict = WorkerWatch.judge(
            state["watch"], finished=finished, master=ours, now=clock.now(),
            grace_s=config.coordination.lease_s)
        if verdict is Verdict.FINISHED:
            raise RunCompleted(worker_message(run_id, config.run.iterations, rank))

    return check
