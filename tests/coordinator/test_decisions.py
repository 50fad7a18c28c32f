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
    GatherAction,
    Heard,
    Liveness,
    MasterAction,
    MasterFound,
    MasterNews,
    Membership,
    Quorum,
    ReleaseAction,
    RunFlags,
    Seen,
    StepAction,
    abort_kind,
    announced,
    collective_flags,
    current,
    from_master,
    judge_arrivals,
    judge_gathering,
    judge_liveness,
    judge_master,
    judge_release,
    master_before_group,
    rerun_phases,
    session_is_ours,
    step_action,
    usable_arrival,
)
from coordinator.records.phases import Phase
from coordinator.records.records import (
    Abort,
    AbortKind,
    Arrival,
    ArrivalStatus,
    Decision,
    Heartbeat,
    NodeState,
    Release,
)


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


# -- the barrier's waits, as tables: a heartbeat or record read -> what the waiter does --

M = Membership(run_id="r", generation=0, session="s", rank=1, token="t1",
               members={0: "t0", 1: "t1", 2: "t2"}, hosts={})
AT = (1, int(Phase.READY_TO_TRAIN))
ABORT = Abort(kind=AbortKind.FAILED, reason="rank 2 failed", rank=2, iteration=1, phase=AT[1])


def beat(rank: int = 0, **changes: object) -> Heartbeat:
    fields: dict[str, object] = dict(
        run_id="r", generation=0, rank=rank, token=f"t{rank}", host="h", pid=1, counter=1,
        state=NodeState.RUNNING, iteration=1, phase=AT[1], waiting_for="", arrived=AT,
        released=AT, session="s", resume_iteration=0, abort=None, error=None, wall_time=0.0)
    fields.update(changes)
    return Heartbeat(**fields)  # type: ignore[arg-type]


FROM_MASTER = [  # the master's heartbeat -> what a worker at barrier AT does
    (None, Heard.NOTHING),
    (beat(), Heard.RELEASED),
    (beat(released=(1, AT[1] - 1)), Heard.NOTHING),  # the barrier before
    (beat(released=None), Heard.NOTHING),
    (beat(session="older"), Heard.NOTHING),  # a release of another session
    (beat(generation=1), Heard.NOTHING),
    (beat(run_id="other"), Heard.NOTHING),
    (beat(token="t9"), Heard.NOTHING),  # another daemon holds rank 0 now
    (beat(abort=ABORT), Heard.ABORTED),
    (beat(abort=ABORT, generation=1, released=None), Heard.ABORTED),  # gave up: any generation
    (beat(abort=ABORT, token="t9"), Heard.NOTHING),  # not this session's master
]


@pytest.mark.parametrize(("hb", "heard"), FROM_MASTER)
def test_a_worker_reads_the_masters_heartbeat_as_a_table(hb: Heartbeat | None,
                                                         heard: Heard) -> None:
    assert from_master(hb, M, AT) is heard


ANNOUNCED = [  # rank 2's heartbeat -> whether the master opens its arrival at AT
    (None, False),
    (beat(2), True),
    (beat(2, arrived=(1, AT[1] - 1)), False),
    (beat(2, token="t1"), False),
    (beat(2, generation=1), False),
    (beat(2, session="older"), True),  # an arrival does not depend on the session
]


@pytest.mark.parametrize(("hb", "opens"), ANNOUNCED)
def test_the_master_opens_an_arrival_only_once_its_rank_announced_it(
        hb: Heartbeat | None, opens: bool) -> None:
    assert announced(hb, M, 2, "arrived", AT) is opens


def test_an_arrival_counts_only_for_this_session_its_rank_holder_and_barrier() -> None:
    good = arrival(2)
    assert usable_arrival(good, M, 2, AT)
    assert not usable_arrival(None, M, 2, AT)
    assert not usable_arrival(arrival(1), M, 2, AT)  # rank 1's token
    assert not usable_arrival(arrival(2, phase=Phase.SYNC), M, 2, AT)
    for change in ({"session": "older"}, {"generation": 1}, {"run_id": "other"}):
        foreign = Arrival(**{**good.__dict__, **change})
        assert not current(foreign, M) and not usable_arrival(foreign, M, 2, AT)


def release(**changes: object) -> Release:
    fields: dict[str, object] = dict(run_id="r", generation=0, session="s", iteration=1,
                                     phase=AT[1], decision=Decision.CONTINUE, abort=None,
                                     payload={})
    fields.update(changes)
    return Release(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("record", "action"), [
    (None, ReleaseAction.IGNORE),
    (release(), ReleaseAction.CONTINUE),
    (release(decision=Decision.ABORT, abort=ABORT), ReleaseAction.ABORT),
    (release(session="older"), ReleaseAction.IGNORE),
    (release(generation=1, decision=Decision.ABORT, abort=ABORT), ReleaseAction.IGNORE),
])
def test_a_worker_judges_the_release_it_read_as_a_table(record: Release | None,
                                                        action: ReleaseAction) -> None:
    assert judge_release(record, M) is action


# -- forming the group, as tables --


@pytest.mark.parametrize(("hb", "seen", "liveness"), [
    (beat(2, counter=5), None, Liveness.FIRST_SEEN),
    (beat(2, counter=5), Seen(5, 0.0, "t2"), Liveness.STALLED),  # a dead daemon's files
    (beat(2, counter=6), Seen(5, 0.0, "t2"), Liveness.ALIVE),
    (beat(2, counter=6, token="t9"), Seen(5, 0.0, "t2"), Liveness.FIRST_SEEN),  # restarted
])
def test_only_a_counter_seen_advancing_proves_a_daemon_alive(
        hb: Heartbeat, seen: Seen | None, liveness: Liveness) -> None:
    assert judge_liveness(hb, seen) is liveness


SHRINK = Quorum(nodes=2, after_s=30.0, rule="coordination.min_nodes=2")


@pytest.mark.parametrize(("missing", "present", "waited", "quorum", "action"), [
    (0, 3, 0.0, None, GatherAction.FORM),
    (1, 2, 1e9, None, GatherAction.WAIT),  # no quorum: every rank, up to the deadline
    (1, 2, 29.0, SHRINK, GatherAction.WAIT),
    (1, 2, 30.0, SHRINK, GatherAction.FORM),  # shrink: enough of them once its time passed
    (2, 1, 30.0, SHRINK, GatherAction.TOO_FEW),
    (0, 3, 0.0, SHRINK, GatherAction.FORM),
])
def test_the_master_forms_the_group_waits_or_refuses_as_a_table(
        missing: int, present: int, waited: float, quorum: Quorum | None,
        action: GatherAction) -> None:
    assert judge_gathering(missing=missing, present=present, waited_s=waited,
                           quorum=quorum) is action


FRESH = Seen(2, 100.0, "t0")  # counter 2 seen at t = 100 s


@pytest.mark.parametrize(("hb", "now", "news", "seen_at"), [
    (None, 101.0, MasterNews.WAIT, 100.0),
    (None, 116.0, MasterNews.SILENT, 100.0),  # no heartbeat for a lease (15 s)
    (beat(session=None, counter=3), 116.0, MasterNews.WAIT, 116.0),  # it advanced: lease anew
    (beat(counter=3), 101.0, MasterNews.SESSION, 101.0),
    (beat(counter=2), 116.0, MasterNews.SILENT, 100.0),  # the counter seen: no advance
    (beat(token="t9", counter=3), 101.0, MasterNews.WAIT, 100.0),  # not this master
    (beat(state=NodeState.FINISHED, session=None), 101.0, MasterNews.COMPLETED_BEFORE, 100.0),
    (beat(state=NodeState.FINISHED), 101.0, MasterNews.COMPLETED, 100.0),
    (beat(state=NodeState.FAILED, abort=ABORT), 101.0, MasterNews.GAVE_UP, 100.0),
    (beat(state=NodeState.FAILED, error="boom"), 101.0, MasterNews.STOPPED, 100.0),
])
def test_a_worker_reads_the_master_while_the_group_forms_as_a_table(
        hb: Heartbeat | None, now: float, news: MasterNews, seen_at: float) -> None:
    got, seen = master_before_group(hb, "t0", FRESH, now=now, lease_s=15.0)
    assert (got, seen.at) == (news, seen_at)


def test_a_worker_joins_only_the_announced_session_of_its_run_that_names_it() -> None:
    from coordinator.records.records import Session

    session = Session(run_id="r", generation=0, session="s2", start_iteration=0,
                      end_iteration=2, members={"0": "t0", "1": "t1"})
    ours = dict(announced="s2", run_id="r", generation=0, exclude=None, rank=1, token="t1")
    assert session_is_ours(session, **ours)  # type: ignore[arg-type]
    for change in ({"announced": "s3"}, {"run_id": "x"}, {"generation": 1},
                   {"exclude": "s2"}, {"token": "t-older"}, {"rank": 2}):
        assert not session_is_ours(session, **{**ours, **change})  # type: ignore[arg-type]
    assert not session_is_ours(None, **ours)  # type: ignore[arg-type]


def test_a_worker_looking_for_its_master_judges_rank_0s_records_as_a_table() -> None:
    from coordinator.records.records import Claim, Manifest

    run = Manifest(run_id="0123abcd", generation=0, num_nodes=3, weights=(1.0, 1.0, 1.0), config={},
                   config_hash="h", created=0.0)
    claim = Claim(run_id="0123abcd", generation=0, rank=0, token="t0", host="h", address="127.0.0.1",
                  probe_port=None, pid=1, started=0.0)
    first = Seen(1, 0.0, "t0")
    table = [  # manifest, claim, heartbeat, the master left, seen -> verdict
        (None, None, None, None, None, MasterFound.NO_RUN),
        (run, None, None, None, None, MasterFound.UNREGISTERED),
        (run, claim, beat(counter=1), None, None, MasterFound.UNPROVEN),  # first seen
        (run, claim, beat(counter=1), None, first, MasterFound.UNPROVEN),  # no advance
        (run, claim, beat(counter=2), None, first, MasterFound.FOUND),
        (run, claim, beat(token="t9", counter=2), None, first, MasterFound.UNREGISTERED),
        (run, Claim(**{**claim.__dict__, "generation": 1}), beat(counter=2), None, first,
         MasterFound.UNREGISTERED),  # a claim of another generation
        (run, claim, beat(state=NodeState.LEFT, counter=2), None, first, MasterFound.NOT_LIVE),
        (run, claim, beat(state=NodeState.FAILED), None, first, MasterFound.NOT_LIVE),
        (run, claim, beat(state=NodeState.FAILED), "t0", first, MasterFound.GAVE_UP),
        (run, None, beat(state=NodeState.FAILED), "t0", None, MasterFound.GAVE_UP),  # released
    ]
    for manifest, c, hb, left, seen, verdict in table:
        assert judge_master(manifest, c, hb, gave_up_token=left, seen=seen) is verdict, \
            (c, hb, left, seen)
