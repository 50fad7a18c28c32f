"""The phase machine's decisions: pure functions from what was observed to an enum.

    step_action(collective, journal_done, run_flag)  -> StepAction   run or skip
    judge_arrivals(arrivals)                         -> Verdict      release or abort
    collective_flags(phases, phase, arrivals)        -> RunFlags     who reruns a collective
    abort_kind(error)                                -> AbortKind    how a failure reads
    abort_of(error, iteration, phase)                -> Abort        the master's abort record
    announced(heartbeat, membership, rank, ...)      -> bool         open that rank's record?
    usable_arrival(arrival, membership, rank, at)    -> bool         does it count here?
    from_master(heartbeat, membership, at)           -> Heard        a worker's barrier: wait,
                                                                     open the release, or abort
    judge_release(release, membership)               -> ReleaseAction continue or abort
    judge_liveness(heartbeat, seen)                  -> Liveness     only an advancing counter
                                                                     proves a daemon alive
    judge_gathering(missing, present, waited, quorum) -> GatherAction form the group, wait, or
                                                                     refuse it (too few)
    master_before_group(heartbeat, token, seen, ...) -> MasterNews   a worker waiting for its
                                                                     session
    session_is_ours(session, ...)                    -> bool         the session to join
    judge_master(manifest, claim, heartbeat, ...)    -> MasterFound  a worker looking for a
                                                                     live master

The daemon (coordinator/machine/daemon.py) does every read and write; these take
values and return values, so each rule is unit-tested without files,
processes or clocks (the executor/decision split of torch elastic's
dynamic rendezvous).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from coordinator.errors import (
    CoordinatorError,
    ExitCode,
    Interrupted,
    MalformedRecordError,
    PeerLostError,
    UsageError,
    WaitTimeout,
)
from coordinator.records.phases import Phase, spec
from coordinator.records.records import (
    LIVE_STATES,
    Abort,
    AbortKind,
    Arrival,
    ArrivalStatus,
    Claim,
    Decision,
    Heartbeat,
    Manifest,
    NodeState,
    Record,
    Release,
    Session,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Membership:
    """Who is in this session of the group, as the master's session record says."""

    run_id: str
    generation: int
    session: str
    rank: int
    token: str
    members: Mapping[int, str]
    hosts: Mapping[int, str]

    @classmethod
    def of(cls, session: Session, *, rank: int, token: str,
           hosts: Mapping[int, str]) -> Membership:
        return cls(run_id=session.run_id, generation=session.generation,
                   session=session.session, rank=rank, token=token,
                   members={int(r): t for r, t in session.members.items()}, hosts=dict(hosts))

    @property
    def is_master(self) -> bool:
        return self.rank == 0



class Heard(str, enum.Enum):
    """What the master's heartbeat tells a worker waiting at a barrier."""

    NOTHING = "nothing"  # not (yet) this barrier's release, or not this master: wait
    RELEASED = "released"  # it announces this barrier's release: open release.json
    ABORTED = "aborted"  # it carries an abort: fail with it


def from_master(hb: Heartbeat | None, m: Membership, at: tuple[int, int]) -> Heard:
    """A worker's reading of the master's heartbeat at barrier `at` (iteration, phase).
    An abort counts whatever its generation, once the heartbeat is this session's
    master's (its token): a master that gave up says so there first."""
    if hb is not None and hb.token == m.members[0] and hb.abort is not None:
        return Heard.ABORTED
    return Heard.RELEASED if announced(hb, m, 0, "released", at) else Heard.NOTHING


def announced(hb: Heartbeat | None, m: Membership, rank: int, field: str,
              at: tuple[int, int]) -> bool:
    """Whether rank `rank`'s heartbeat says it published its record of barrier `at`
    (`field`: "arrived" or "released"), in this run, generation and (a release)
    session, from the member that holds the rank now (its token)."""
    if hb is None or hb.token != m.members[rank]:
        return False
    if hb.run_id != m.run_id or hb.generation != m.generation:
        return False
    if field == "released" and hb.session != m.session:
        return False
    return bool(getattr(hb, field) == at)


def current(record: Arrival | Release, m: Membership) -> bool:
    """Whether a record belongs to this run, generation and session."""
    return (record.run_id == m.run_id and record.generation == m.generation
            and record.session == m.session)


def usable_arrival(record: Arrival | None, m: Membership, rank: int,
                   at: tuple[int, int]) -> bool:
    """Whether an arrival read for rank `rank` counts at barrier `at`: this session's,
    from the member holding the rank, for this barrier."""
    return record is not None and current(record, m) and record.token == m.members[rank] \
        and (record.iteration, record.phase) == at


class ReleaseAction(str, enum.Enum):
    IGNORE = "ignore"  # none, or another session's: wait on
    CONTINUE = "continue"  # the master released the barrier
    ABORT = "abort"  # the master aborted the phase


def judge_release(record: Release | None, m: Membership) -> ReleaseAction:
    """A worker's verdict on the release it read after the master announced it."""
    if record is None or not current(record, m):
        return ReleaseAction.IGNORE
    if record.decision is Decision.ABORT and record.abort is not None:
        return ReleaseAction.ABORT
    return ReleaseAction.CONTINUE


class StepAction(str, enum.Enum):
    """What a rank does with a phase's action."""

    RUN = "run"
    SKIP_DONE = "skip-done"  # its journal says it completed (a resume): never redone
    SKIP_COLLECTIVE = "skip-collective"  # every rank completed this collective phase


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunFlags(Record):
    """The `run` field of a release: for the next collective phase, whether it runs.

    A collective step (training) runs on every rank or on none: it is rerun
    unless every rank reported it done at the previous barrier.
    """

    SCHEMA: ClassVar[str] = "coordinator/run-flags"
    run: dict[str, bool]

    def runs(self, phase: Phase) -> bool | None:
        return self.run.get(str(int(phase)))

    @classmethod
    def of(cls, payload: Mapping[str, Any], path: Path) -> RunFlags:
        return cls.from_fields({"run": payload.get("run", {})}, path)


# A decision's release may name phases of the same iteration that every rank
# runs again even if its journal marks them done (actions are idempotent): the
# RL loop's phase 0 does, once a shrunk group has taken over a lost rank's tasks.
RERUN = "rerun"


def rerun_phases(releases: Mapping[int, Mapping[str, Any]], where: Path) -> frozenset[int]:
    """The phases the releases passed so far in this iteration ask to run again."""
    asked: set[int] = set()
    for payload in releases.values():
        phases = payload.get(RERUN, [])
        if not isinstance(phases, list) or not all(
                type(p) is int and 0 <= p < len(Phase) for p in phases):
            raise MalformedRecordError(where, f"{RERUN} is {phases!r}: expected a list of phases")
        asked.update(phases)
    return frozenset(asked)


def step_action(*, collective: bool, journal_done: bool, run_flag: bool | None,
                rerun: bool = False) -> StepAction:
    """Run or skip this rank's action.

    An ordinary action is skipped when this rank's journal marks it done,
    unless a release of this iteration asked to `rerun` it.  A collective one
    follows the master's flag from the previous release (a missing flag means
    run), whatever this rank's journal says: if one rank must redo it, all must.
    """
    if collective:
        return StepAction.SKIP_COLLECTIVE if run_flag is False else StepAction.RUN
    return StepAction.SKIP_DONE if journal_done and not rerun else StepAction.RUN


class MasterAction(str, enum.Enum):
    WAIT = "wait"  # ranks are still missing
    RELEASE = "release"  # every rank arrived and none failed
    ABORT = "abort"  # a rank reported its action failed


@dataclasses.dataclass(frozen=True)
class Verdict:
    action: MasterAction
    failed: Arrival | None = None  # with ABORT: the first failed arrival, by rank


def judge_arrivals(arrivals: Mapping[int, Arrival], members: Sequence[int]) -> Verdict:
    """The master's verdict on the arrivals read so far at one barrier."""
    failed = [arrivals[r] for r in sorted(arrivals) if arrivals[r].status is ArrivalStatus.FAILED]
    if failed:
        return Verdict(MasterAction.ABORT, failed[0])
    if all(r in arrivals for r in members):
        return Verdict(MasterAction.RELEASE)
    return Verdict(MasterAction.WAIT)


def collective_flags(phases: Sequence[Phase], phase: Phase,
                     arrivals: Mapping[int, Arrival]) -> RunFlags | None:
    """For the phase after `phase`, if it is collective: whether it runs.

    It is skipped only when every rank reported it done in this barrier's
    arrival (all ranks finished it before a restart); otherwise every rank
    runs it, together.
    """
    later = [p for p in phases if p > phase]
    if not later or not spec(later[0]).collective:
        return None
    nxt = later[0]
    everyone_done = all(int(nxt) in a.done for a in arrivals.values())
    return RunFlags(run={str(int(nxt)): not everyone_done})


def abort_of(error: BaseException, *, iteration: int, phase: int) -> Abort:
    """The master's abort record for `error` at (iteration, phase)."""
    return Abort(kind=abort_kind(error), reason=str(error), rank=getattr(error, "rank", None),
                 iteration=iteration, phase=int(phase))


def abort_kind(error: BaseException) -> AbortKind:
    """How a failure reads in the master's abort, and so in every worker's exit code."""
    if isinstance(error, (PeerLostError, Interrupted)):
        return AbortKind.LOST  # a rank is gone (or leaving): peers exit as for a lost rank
    if isinstance(error, WaitTimeout):
        return AbortKind.TIMEOUT
    if isinstance(error, UsageError) or getattr(error, "exit_code", None) == ExitCode.USAGE:
        return AbortKind.USAGE
    if isinstance(error, CoordinatorError):
        return AbortKind.FAILED
    return AbortKind.INTERNAL


# -- forming the group (coordinator/machine/membership.py waits on these) --


@dataclasses.dataclass(frozen=True)
class Seen:
    """A rank's heartbeat counter as a waiter last saw it change, and when."""

    counter: int
    at: float
    token: str


class Liveness(str, enum.Enum):
    FIRST_SEEN = "first-seen"  # remember its counter: a dead daemon's files look alive
    STALLED = "stalled"  # the counter seen before: not proven alive (yet)
    ALIVE = "alive"  # the counter advanced: a live daemon


def judge_liveness(hb: Heartbeat, seen: Seen | None) -> Liveness:
    """Whether a heartbeat proves its daemon alive, against the one seen before.  A
    claim and heartbeat left by a daemon that died look exactly like a live one:
    only a counter seen advancing, under the same token, proves life."""
    if seen is None or seen.token != hb.token:
        return Liveness.FIRST_SEEN
    return Liveness.STALLED if hb.counter == seen.counter else Liveness.ALIVE


@dataclasses.dataclass(frozen=True, kw_only=True)
class Quorum:
    """When the master may form a group without every rank (gather_members)."""

    nodes: int  # ranks present, the master included
    after_s: float  # from the start of the wait
    rule: str  # what asks for it, for the error: "coordination.min_nodes=2"


class GatherAction(str, enum.Enum):
    WAIT = "wait"  # ranks are missing, and no quorum lets the group form without them
    FORM = "form"  # every rank is in, or the quorum's time has passed with enough of them
    TOO_FEW = "too-few"  # the quorum's time has passed with fewer ranks than it needs


def judge_gathering(*, missing: int, present: int, waited_s: float,
                    quorum: Quorum | None) -> GatherAction:
    """The master's verdict while it gathers the ranks: `present` counts itself."""
    if not missing:
        return GatherAction.FORM
    if quorum is not None and waited_s >= quorum.after_s:
        return GatherAction.FORM if present >= quorum.nodes else GatherAction.TOO_FEW
    return GatherAction.WAIT


class MasterNews(str, enum.Enum):
    """What the master's heartbeat tells a worker waiting for its session."""

    WAIT = "wait"  # no session yet (or not this master's heartbeat)
    SESSION = "session"  # it names a session: open session.json
    COMPLETED_BEFORE = "completed-before"  # restarted on a complete run, it exited at once
    COMPLETED = "completed"  # it completed the run without this rank
    GAVE_UP = "gave-up"  # it stopped the run with an abort (a setting refused)
    STOPPED = "stopped"  # it stopped before the group formed
    SILENT = "silent"  # its counter has not advanced for a lease


def master_before_group(hb: Heartbeat | None, master_token: str, seen: Seen, *, now: float,
                        lease_s: float) -> tuple[MasterNews, Seen]:
    """A worker's reading of the master's heartbeat while the group forms, and the
    counter seen (its change restarts the lease)."""
    if hb is not None and hb.token == master_token:
        if hb.state is NodeState.FINISHED:
            return (MasterNews.COMPLETED_BEFORE if hb.session is None
                    else MasterNews.COMPLETED), seen
        if hb.state not in LIVE_STATES:
            return (MasterNews.GAVE_UP if hb.abort is not None else MasterNews.STOPPED), seen
        if hb.counter != seen.counter:
            seen = Seen(hb.counter, now, seen.token)
    if now - seen.at > lease_s:
        return MasterNews.SILENT, seen
    if hb is None or hb.token != master_token or hb.session is None:
        return MasterNews.WAIT, seen
    return MasterNews.SESSION, seen


def session_is_ours(session: Session | None, *, announced: str, run_id: str, generation: int,
                    exclude: str | None, rank: int, token: str) -> bool:
    """Whether the session read is the one the master announced, of this run and
    generation, not the one this daemon left (`exclude`), naming this daemon (a
    session naming another incarnation of the rank is an older group's: the master
    notices this daemon and forms a new one)."""
    return (session is not None and session.session == announced and session.run_id == run_id
            and session.generation == generation and session.session != exclude
            and session.token_of(rank) == token)


class MasterFound(str, enum.Enum):
    """What a worker looking for its master (at start, or to rejoin) finds."""

    NO_RUN = "no-run"  # no run manifest yet
    GAVE_UP = "gave-up"  # the master it was with stopped for good (its heartbeat: failed)
    UNREGISTERED = "unregistered"  # no current claim and heartbeat of rank 0
    NOT_LIVE = "not-live"  # its last heartbeat says it stopped: it may be restarted
    UNPROVEN = "unproven"  # a live-looking heartbeat, its counter not yet seen advancing
    FOUND = "found"  # a live master of the current run and generation


def judge_master(manifest: Manifest | None, claim: Claim | None, hb: Heartbeat | None, *,
                 gave_up_token: str | None, seen: Seen | None) -> MasterFound:
    """A worker's verdict on rank 0's records (`seen`: its heartbeat as first seen under
    its token).  A master that stopped for good has released its claim: its failed
    heartbeat is judged before the claim."""
    if manifest is None:
        return MasterFound.NO_RUN
    if hb is not None and hb.token == gave_up_token and hb.state is NodeState.FAILED:
        return MasterFound.GAVE_UP
    if claim is None or hb is None or claim.run_id != manifest.run_id or \
            hb.token != claim.token or claim.generation != manifest.generation:
        return MasterFound.UNREGISTERED
    if hb.state not in LIVE_STATES:
        return MasterFound.NOT_LIVE
    return MasterFound.FOUND if judge_liveness(hb, seen) is Liveness.ALIVE \
        else MasterFound.UNPROVEN
