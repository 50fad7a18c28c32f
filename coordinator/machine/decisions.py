"""The phase machine's decisions: pure functions from what was observed to an enum.

    step_action(collective, journal_done, run_flag)  -> StepAction   run or skip
    judge_arrivals(arrivals)                         -> Verdict      release or abort
    collective_flags(phases, phase, arrivals)        -> RunFlags     who reruns a collective
    abort_kind(error)                                -> AbortKind    how a failure reads
    abort_of(error, iteration, phase)                -> Abort        the master's abort record

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
from coordinator.records.records import Abort, AbortKind, Arrival, ArrivalStatus, Record


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
