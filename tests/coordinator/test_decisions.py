"""The phase machine's decisions, as pure functions: no files, processes or clocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.errors import (
    ActionError,
    CoordinatorError,
    Interrupted,
    MalformedRecordError,
    PeerLostError,
    WaitTimeout,
)
from coordinator.machine.decisions import (
    MasterAction,
    RunFlags,
    StepAction,
    abort_kind,
    collective_flags,
    judge_arrivals,
    rerun_phases,
    step_action,
)
from coordinator.records.phases import Phase
from coordinator.records.records import AbortKind, Arrival, ArrivalStatus


def arrival(rank: int, *, phase: Phase = Phase.READY_TO_TRAIN, done: tuple[int, ...] = (),
            failed: str | None = None) -> Arrival:
    return Arrival(run_id="r", generation=0, session="s", rank=rank, token=f"t{rank}",
                   iteration=1, phase=int(phase),
                   status=ArrivalStatus.FAILED if failed else ArrivalStatus.OK, error=failed,
                   done=done, payload={})


def test_an_action_the_journal_marks_done_is_skipped_never_redone() -> None:
    assert step_action(collective=False, journal_done=True, run_flag=None) is StepAction.SKIP_DONE
    assert step_action(collective=False, journal_done=False, run_flag=None) is StepAction.RUN


def test_a_collective_phase_reruns_on_every_rank_when_only_some_report_it_done() -> None:
    phases = tuple(Phase)
    some = {0: arrival(0, done=(10,)), 1: arrival(1, done=(10,)), 2: arrival(2, done=())}
    flags = collective_flags(phases, Phase.READY_TO_TRAIN, some)
    assert flags == RunFlags(run={"10": True})
    # A rank that finished it before the restart runs it again, with the others.
    assert step_action(collective=True, journal_done=True, run_flag=flags.runs(Phase.TRAIN)) \
        is StepAction.RUN
    everyone = {r: arrival(r, done=(10,)) for r in range(3)}
    flags = collective_flags(phases, Phase.READY_TO_TRAIN, everyone)
    assert flags == RunFlags(run={"10": False})
    assert step_action(collective=True, journal_done=False, run_flag=False) \
        is StepAction.SKIP_COLLECTIVE
    # No flag (an older release) means run; a phase before an ordinary one gets none.
    assert step_action(collective=True, journal_done=True, run_flag=None) is StepAction.RUN
    assert collective_flags(phases, Phase.SYNC, everyone) is None
    assert collective_flags(tuple(p for p in Phase if p <= Phase.EVAL), Phase.EVAL, everyone) is None


def test_run_flags_are_parsed_strictly_from_a_release() -> None:
    where = Path("/run/iterations/000001/phase-09/release.json")
    assert RunFlags.of({"run": {"10": False}, "master_addr": "x"}, where).runs(Phase.TRAIN) \
        is False
    assert RunFlags.of({}, where).runs(Phase.TRAIN) is None
    with pytest.raises(MalformedRecordError, match=r"phase-09/release\.json"):
        RunFlags.of({"run": {"10": "yes"}}, where)


def test_the_master_aborts_on_a_failed_arrival_naming_the_first_failed_rank() -> None:
    members = [0, 1, 2]
    verdict = judge_arrivals({0: arrival(0), 2: arrival(2, failed="boom"),
                              1: arrival(1, failed="first")}, members)
    assert verdict.action is MasterAction.ABORT
    assert verdict.failed is not None and verdict.failed.rank == 1
    # A failure ends the wait even while other ranks are still missing.
    assert judge_arrivals({0: arrival(0), 2: arrival(2, failed="x")}, members).action \
        is MasterAction.ABORT
    assert judge_arrivals({0: arrival(0), 1: arrival(1)}, members).action is MasterAction.WAIT
    assert judge_arrivals({r: arrival(r) for r in members}, members).action \
        is MasterAction.RELEASE


def test_one_rule_decides_how_every_failure_reads_in_the_abort() -> None:
    assert abort_kind(PeerLostError("gone", rank=2)) is AbortKind.LOST
    assert abort_kind(Interrupted(15)) is AbortKind.LOST  # a rank leaving is a rank lost
    assert abort_kind(WaitTimeout("late")) is AbortKind.TIMEOUT
    assert abort_kind(ActionError("bad")) is AbortKind.FAILED
    assert abort_kind(CoordinatorError("x")) is AbortKind.FAILED
    assert abort_kind(RuntimeError("bug")) is AbortKind.INTERNAL


def test_a_release_asking_for_a_rerun_runs_a_journal_done_action_again() -> None:
    where = Path("run/iterations/000003")
    releases = {0: {"policy": "initial", "rerun": [1, 2, 3]}}
    asked = rerun_phases(releases, where)
    assert asked == {1, 2, 3}
    assert step_action(collective=False, journal_done=True, run_flag=None,
                       rerun=1 in asked) is StepAction.RUN
    assert step_action(collective=False, journal_done=True, run_flag=None,
                       rerun=4 in asked) is StepAction.SKIP_DONE
    assert rerun_phases({0: {"policy": "initial"}}, where) == frozenset()
    for bad in ("1", [1, "2"], [99], [True]):
        with pytest.raises(MalformedRecordError, match="rerun is"):
            rerun_phases({0: {"rerun": bad}}, where)
