"""Automatic recovery: the group re-forms after a lost rank or a failed step.

With coordination.on_failure "wait" (the default) a daemon that meets a
failure it can recover from (a rank lost, left or restarted, a step that
failed: exit codes 3 and 4) does not exit:

    running ──failure──► regrouping ──new session──► running (resume iteration)
                             │
                             └─ rejoin_timeout_s passed, max_recoveries used up,
                                the same step failed the same way max_attempts
                                times (master: a repeated failure, exit 4),
                                or the master stopped for good ──► exit as today

    every survivor   stops its children, closes its actions, and says
                     `regrouping` in its heartbeat (with the cause); peers that
                     see it regroup too, so the whole group follows within one
                     monitor interval
    the master       waits (rejoin_timeout_s) until every rank is back out of
                     any session: survivors regrouping, the lost rank restarted
                     with its original command; then records the recovery in
                     recoveries.json and publishes a new session (a fresh id:
                     arrivals and releases of the old one are ignored)
    a worker         waits for a live master (the same one, or a restarted
                     one: a master whose heartbeat says `failed` stopped for
                     good, and the worker exits with its cause), then for a
                     session naming it that is not the one it left

The group resumes at the lowest iteration any member's journal has not
completed, replaying its barriers; actions the journals mark done are not
redone.  After a shrink, "member" means of the last session (start_iteration),
and a rank left out that is back waits for the end of an iteration the others
worked on without it (rejoin_later).  No generation bump is needed: a replaced rank's old incarnation is
fenced by its claim (membership.py), and old-session records by the session id.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar, Final

from coordinator.config.on_failure import policy
from coordinator.config.run_config import MAX_RECOVERIES, CoordinationConfig
from coordinator.errors import (
    CoordinatorError,
    ExitCode,
    FencedError,
    Interrupted,
    PeerLostError,
    PhaseFailedError,
    fault_signature,
)
from coordinator.records import layout
from coordinator.records.phases import Phase
from coordinator.records.records import (
    Heartbeat,
    Journal,
    NodeState,
    Record,
    Session,
    check_iteration,
    check_phase,
)
from coordinator.storage.store import Store, publish_record, read_record

log = logging.getLogger("coordinator")

RECOVERABLE: Final = (ExitCode.PEER_LOST, ExitCode.PHASE_FAILED)
MAX_CAUSE_CHARS: Final = 2000


def fault_of(error: CoordinatorError) -> str:
    """The signature of a failed step (what went wrong, not where or on which rank:
    errors.fault_signature), or "" for a failure that is not a step's own: a rank
    lost, left or restarted."""
    if not isinstance(error, PhaseFailedError) or error.exit_code is not ExitCode.PHASE_FAILED:
        return ""
    return error.fault if error.fault is not None else \
        fault_signature(error.cause or str(error))


class RepeatedFailure(PhaseFailedError):
    """One step failed the same way coordination.max_attempts times: the run stops
    (exit 4) under every on_failure, since a retry would meet the cause again."""


def regroups(coord: CoordinationConfig, *, recoveries: int) -> bool:
    """Whether this daemon would regroup after a recoverable failure now."""
    return policy(coord.on_failure).regroups and recoveries < coord.max_recoveries


def recoverable(error: CoordinatorError, coord: CoordinationConfig, *, recoveries: int) -> bool:
    """Whether a daemon regroups after `error` instead of exiting."""
    if isinstance(error, (Interrupted, FencedError, RepeatedFailure)) or \
            error.exit_code not in RECOVERABLE:
        # Told to stop, superseded, a failure that will recur, or the run dir is unusable.
        return False
    if policy(coord.on_failure).regroups and not regroups(coord, recoveries=recoveries):
        log.error("coordination.max_recoveries=%d recoveries already made in this run: "
                  "stopping instead", coord.max_recoveries)
    return regroups(coord, recoveries=recoveries)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Incident:
    """What went wrong, as the daemon that saw it knows it."""

    rank: int | None  # the rank lost or failed; None when unknown
    host: str
    iteration: int
    phase: int
    cause: str
    detected_by: int
    detected_at: float  # wall time on the detecting host
    fault: str = ""  # fault_of(error): "" when no step of its own failed

    @classmethod
    def of(cls, error: CoordinatorError, *, by: int, where: Heartbeat) -> Incident:
        rank = getattr(error, "rank", None)
        iteration = getattr(error, "iteration", None)
        phase = getattr(error, "phase", None)
        return cls(rank=rank if isinstance(rank, int) and rank >= 0 else None,
                   host=str(getattr(error, "host", None) or "?"),
                   iteration=iteration if isinstance(iteration, int) else where.iteration,
                   phase=phase if isinstance(phase, int) else where.phase,
                   cause=str(error)[:MAX_CAUSE_CHARS], detected_by=by, detected_at=time.time(),
                   fault=fault_of(error))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recovery(Record):
    """One automatic recovery, as recoveries.json keeps it."""

    SCHEMA: ClassVar[str] = "coordinator/recovery"
    number: int
    rank: int | None
    host: str
    iteration: int
    phase: int
    cause: str
    detected_by: int
    detected_at: float
    resumed_at: float
    resumed_after_s: float
    resume_iteration: int
    # Per rank: the phases of resume_iteration its journal does not mark done,
    # which the group now runs (again, for the one that was interrupted).
    pending: dict[str, tuple[int, ...]]
    members: dict[str, str]  # rank -> host of the re-formed group
    # Ranks the group went on without (on_failure "shrink"); they rejoin at an
    # iteration boundary once restarted.
    left_out: tuple[int, ...]
    # The failed step's signature (fault_of); "" for a lost rank.  The same
    # step failing with the same one max_attempts times stops the run.
    fault: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.number <= MAX_RECOVERIES:
            raise ValueError(f"recovery number {self.number} is outside 1..{MAX_RECOVERIES}")
        check_iteration(self.iteration)
        check_iteration(self.resume_iteration)
        check_phase(self.phase)
        for phases in self.pending.values():
            for phase in phases:
                check_phase(phase)

    def describe(self) -> str:
        who = f"rank {self.rank} (host {self.host})" if self.rank is not None else "a rank"
        pending = "; ".join(f"rank {r}: {_phase_list(p)}" for r, p in sorted(
            self.pending.items(), key=lambda kv: int(kv[0])))
        return (f"recovery {self.number}: {who} at iteration {self.iteration} "
                f"{_label(self.phase)}: {self.cause} | group resumed after "
                f"{self.resumed_after_s:.1f} s at iteration {self.resume_iteration}"
                + (f" without rank(s) {list(self.left_out)} (their unfinished tasks go to the "
                   "others)" if self.left_out else "")
                + f"; to run: {pending}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecoveryLog(Record):
    """recoveries.json: every recovery of the run, oldest first; written by the master."""

    SCHEMA: ClassVar[str] = "coordinator/recoveries"
    run_id: str
    recoveries: tuple[Recovery, ...]

    def __post_init__(self) -> None:
        if len(self.recoveries) > MAX_RECOVERIES:
            raise ValueError(f"{len(self.recoveries)} recoveries: at most {MAX_RECOVERIES}")


def repeated_failure(history: RecoveryLog, incident: Incident, *,
                     max_attempts: int) -> RepeatedFailure | None:
    """The error that stops the run when `incident` is the max_attempts-th failure of
    one step (iteration and phase) with one fault; None otherwise.  A pure decision
    from the recovery log: every attempt before this one was recorded there."""
    if not incident.fault:
        return None
    before = [r for r in history.recoveries if (r.iteration, r.phase, r.fault) == (
        incident.iteration, incident.phase, incident.fault)]
    attempts = len(before) + 1
    if attempts < max_attempts:
        return None
    return RepeatedFailure(
        f"iteration {incident.iteration} {_label(incident.phase)} failed the same way "
        f"{attempts} times (coordination.max_attempts={max_attempts}; recoveries "
        f"{', '.join(str(r.number) for r in before) or 'none'} before): {incident.cause} | "
        "retrying will not help: fix the cause, run `coordinator recover` and restart every "
        "node (or raise coordination.max_attempts if the failure is transient)",
        rank=incident.rank, iteration=incident.iteration, phase=incident.phase,
        cause=incident.cause)


def read_log(store: Store, run_id: str, *, retry_s: float) -> RecoveryLog:
    """The run's recoveries (none when the file is absent or from another run)."""
    found = read_record(store, layout.RECOVERIES, RecoveryLog, retry_s=retry_s)
    if found is None or found.run_id != run_id:
        return RecoveryLog(run_id=run_id, recoveries=())
    return found


def record(store: Store, history: RecoveryLog, recovery: Recovery) -> RecoveryLog:
    updated = dataclasses.replace(history, recoveries=(*history.recoveries, recovery))
    publish_record(store, layout.RECOVERIES, updated)
    log.warning("%s", recovery.describe())
    return updated


def pending_phases(store: Store, members: Iterable[int], iteration: int,
                   phases: Iterable[Phase], *, run_id: str,
                   retry_s: float) -> dict[str, tuple[int, ...]]:
    """Per member: the phases of `iteration` its journal does not mark done."""
    phases = tuple(phases)
    out: dict[str, tuple[int, ...]] = {}
    for rank in members:
        journal = read_record(store, layout.journal(rank), Journal, retry_s=retry_s)
        if journal is None or journal.run_id != run_id:
            out[str(rank)] = tuple(int(p) for p in phases)
        else:
            out[str(rank)] = tuple(int(p) for p in phases if not journal.is_done(iteration, p))
    return out


def start_iteration(beats: Mapping[int, Heartbeat], left: Session | None) -> int:
    """Where a new session starts: the lowest iteration a member of the session the
    group left has not completed.  A rank that was not in it (it returns to a group
    that went on without it: on_failure "shrink") does not pull the group back; it
    skips the iterations the group completed without it (JournalBook.skip_to).
    `left` is the run's last session of any generation: `coordinator recover`
    keeps it, so that a restart after it starts where recover said."""
    carried = [hb.resume_iteration for r, hb in beats.items()
               if left is not None and left.token_of(r) is not None]
    return min(carried or [hb.resume_iteration for hb in beats.values()])


def rejoin_later(back: Sequence[int], carried: Session | None, *,
                 pending: Mapping[str, tuple[int, ...]], phases: int,
                 min_nodes: int) -> tuple[int, ...]:
    """The ranks back (the master included) that do not join the session now but
    at the end of its first iteration, like any rank returning to a shrunk group
    (the last phase's admit): those the carried session went on without, when its
    members have done part of that iteration (`pending`: per member, the phases of
    it their journals do not mark done; of `phases` in all).  Joining in the middle
    of an iteration whose work the others did without them, they would make every
    rank run its collective step (training) again.  None wait when the others alone
    would be fewer than min_nodes: a step run again beats a group that cannot go on."""
    if carried is None or all(len(p) == phases for p in pending.values()):
        return ()
    later = tuple(r for r in back if carried.token_of(r) is None)
    return later if len(back) - len(later) >= min_nodes else ()


def incident_from_members(beats: Mapping[int, Heartbeat], previous_master: Heartbeat | None,
                          ) -> Incident | None:
    """A restarted master's view of the failure: members still regrouping say it was
    lost, and where (its previous incarnation's last heartbeat).  The failure came
    after that heartbeat, which therefore dates it: the member's own heartbeat is
    only as old as its last beat (seconds, however long the master was gone), and
    `resumed_after_s` counted from it said the group had waited that little."""
    waiting = sorted((r, hb) for r, hb in beats.items()
                     if r != 0 and hb.state is NodeState.REGROUPING)
    if not waiting:
        return None
    rank, hb = waiting[0]
    where = previous_master or hb
    return Incident(rank=0, host=previous_master.host if previous_master else "?",
                    iteration=where.iteration, phase=where.phase,
                    cause=(hb.error or "the master was lost")[:MAX_CAUSE_CHARS],
                    detected_by=rank, detected_at=where.wall_time)


def rejoin_timeout(what: str, timeout_s: float) -> PeerLostError:
    return PeerLostError(
        f"{what} did not come back within coordination.rejoin_timeout_s={timeout_s:g} s: "
        "restart it with its original command (the run resumes where it stopped), or raise "
        "the timeout", rank=-1)


def _label(phase: int) -> str:
    try:
        return Phase(phase).label
    except ValueError:
        return f"phase {phase}"


def _phase_list(phases: tuple[int, ...]) -> str:
    if not phases:
        return "nothing"
    if list(phases) == list(range(phases[0], phases[-1] + 1)) and len(phases) > 2:
        return f"phases {phases[0]}-{phases[-1]}"
    return "phases " + ",".join(str(p) for p in phases)
