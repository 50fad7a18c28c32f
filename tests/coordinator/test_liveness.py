"""Lease verdicts: a peer is lost when its counter stalls for a lease on *our* clock."""

from __future__ import annotations

from coordinator.errors import PeerLostError, PhaseFailedError
from coordinator.machine.liveness import PeerTracker, rank_failed
from coordinator.records.records import NodeState
from tests.coordinator.test_records import heartbeat


def tracker() -> PeerTracker:
    t = PeerTracker(lease_s=15.0, run_id="r", generation=0)
    t.expect(1, token="t", host="gpu-07", now=0.0)
    return t


def test_an_advancing_heartbeat_keeps_a_peer_alive_however_skewed_its_wall_clock() -> None:
    t = tracker()
    for second in range(0, 100, 2):
        t.observe(1, heartbeat(counter=second, wall_time=-1e9), now=float(second))
        assert t.verdict(1, now=second + 1.0) is None


def test_a_stalled_counter_is_lost_after_the_lease_and_the_verdict_names_rank_host_phase() -> None:
    t = tracker()
    t.observe(1, heartbeat(counter=5, iteration=3, phase=4), now=10.0)
    t.observe(1, heartbeat(counter=5, iteration=3, phase=4), now=20.0)
    assert t.verdict(1, now=24.9) is None
    verdict = t.verdict(1, now=25.5)
    assert isinstance(verdict, PeerLostError)
    assert "rank 1 (host gpu-07) lost at iteration 3 phase 4 (aggregate)" in str(verdict)
    assert "15.5 s" in str(verdict) and verdict.heartbeat_age_s == 15.5


def test_a_peer_that_left_or_failed_is_reported_at_once() -> None:
    t = tracker()
    t.observe(1, heartbeat(counter=1, state=NodeState.LEFT), now=1.0)
    assert isinstance(t.verdict(1, now=1.0), PeerLostError)
    t = tracker()
    t.observe(1, heartbeat(counter=1, state=NodeState.FAILED, error="boom", iteration=1,
                           phase=10), now=1.0)
    verdict = t.verdict(1, now=1.0)
    assert isinstance(verdict, PhaseFailedError)
    # Word for word what the master says when it reads the failed arrival first:
    # which of the two sees the failure first is a race, the message is not.
    assert str(verdict) == str(rank_failed(1, "gpu-07", 1, 10, "boom")) == \
        "rank 1 (host gpu-07) failed iteration 1 phase 10 (train): boom"


def test_a_restarted_peer_with_a_new_token_is_reported_as_restarted_where_it_was() -> None:
    t = tracker()
    t.observe(1, heartbeat(counter=1, iteration=2, phase=10), now=0.5)
    t.observe(1, heartbeat(counter=1, token="other", pid=4242, iteration=0, phase=0), now=1.0)
    verdict = t.verdict(1, now=1.0)
    assert isinstance(verdict, PeerLostError)
    # Where the old incarnation was, not where the new one starts.
    assert "restarted at iteration 2 phase 10 (train) (new pid 4242" in str(verdict)
    assert (verdict.iteration, verdict.phase) == (2, 10)


def test_a_regrouping_peer_counts_as_lost_only_once_it_worked_in_this_session() -> None:
    t = tracker()
    # Still on its way in from the last regroup: the new session is not yet its.
    t.observe(1, heartbeat(counter=1, state=NodeState.REGROUPING, error="old"), now=0.5)
    assert t.verdict(1, now=0.5) is None
    t.observe(1, heartbeat(counter=2, state=NodeState.RUNNING, iteration=1, phase=4), now=1.0)
    t.observe(1, heartbeat(counter=3, state=NodeState.REGROUPING, error="rank 2 lost",
                           iteration=1, phase=4), now=1.5)
    verdict = t.verdict(1, now=1.5)
    assert isinstance(verdict, PeerLostError)
    assert "stopped its work at iteration 1 phase 4 (aggregate) to re-form the group: rank 2 " \
        "lost" in str(verdict)


def test_records_of_another_run_or_an_older_generation_are_no_sign_of_life() -> None:
    t = PeerTracker(lease_s=15.0, run_id="r", generation=2)
    t.expect(1, token="t", host="h", now=0.0)
    t.observe(1, heartbeat(counter=7, run_id="old"), now=5.0)
    t.observe(1, heartbeat(counter=8, generation=1), now=10.0)
    assert isinstance(t.verdict(1, now=16.0), PeerLostError)


def master_tracker() -> PeerTracker:
    t = PeerTracker(lease_s=15.0, run_id="r", generation=0, attribute_s=16.0)
    for rank in (1, 2):
        t.expect(rank, token=f"t{rank}", host=f"gpu-0{rank}", now=0.0)
    return t


def test_a_peer_lost_while_another_reports_a_failed_collective_step_is_the_one_blamed() -> None:
    t = master_tracker()
    # Rank 2 dies at t=1; at t=3 rank 1's training breaks because of it.
    t.observe(2, heartbeat(rank=2, token="t2", counter=1, iteration=1, phase=10), now=1.0)
    for second in range(3, 16):
        t.observe(1, heartbeat(rank=1, token="t1", counter=second, iteration=1, phase=10,
                               state=NodeState.STEP_FAILED, error="torchrun exit 1"),
                  now=float(second))
        assert t.first_verdict(now=float(second)) is None  # rank 2 has not beaten since
    verdict = t.first_verdict(now=16.5)
    assert isinstance(verdict, PeerLostError) and verdict.rank == 2


def test_a_failed_collective_step_is_blamed_once_every_peer_has_beaten_since() -> None:
    t = master_tracker()
    t.observe(1, heartbeat(rank=1, token="t1", counter=1, iteration=1, phase=10,
                           state=NodeState.STEP_FAILED, error="CUDA out of memory"), now=2.0)
    t.observe(2, heartbeat(rank=2, token="t2", counter=1, iteration=1, phase=10), now=2.0)
    assert t.first_verdict(now=2.0) is None  # the attribution starts
    t.observe(1, heartbeat(rank=1, token="t1", counter=2, state=NodeState.STEP_FAILED,
                           error="CUDA out of memory"), now=2.5)
    assert t.first_verdict(now=2.5) is None  # rank 2 has not beaten since
    t.observe(2, heartbeat(rank=2, token="t2", counter=2, iteration=1, phase=10), now=2.6)
    verdict = t.first_verdict(now=2.6)
    assert isinstance(verdict, PhaseFailedError) and verdict.rank == 1
    assert "CUDA out of memory" in str(verdict)


def test_workers_leave_the_attribution_to_the_master() -> None:
    t = PeerTracker(lease_s=15.0, run_id="r", generation=0)  # a worker watches the master
    t.expect(0, token="t0", host="gpu-00", now=0.0)
    t.observe(0, heartbeat(rank=0, token="t0", counter=1, state=NodeState.STEP_FAILED,
                           error="x"), now=1.0)
    for second in range(2, 100):
        t.observe(0, heartbeat(rank=0, token="t0", counter=second, state=NodeState.STEP_FAILED,
                               error="x"), now=float(second))
        assert t.first_verdict(now=float(second)) is None  # alive: its abort will say why


def test_a_peer_regrouping_after_its_own_step_failed_is_that_failure_with_its_fault() -> None:
    from coordinator.machine.regroup import fault_of

    t = tracker()
    t.observe(1, heartbeat(counter=1), now=0.5)  # seen at work in the session
    t.observe(1, heartbeat(counter=2, state=NodeState.REGROUPING, session=None, phase=1,
                           error="rank 1 failed iteration 2 phase 1 (rollout): ActionError: x 7",
                           fault="ActionError: x #"), now=1.0)
    verdict = t.verdict(1, now=1.0)
    assert isinstance(verdict, PhaseFailedError) and fault_of(verdict) == "ActionError: x #"
    # Regrouping because of someone else's failure: it stopped, it did not fail.
    t = tracker()
    t.observe(1, heartbeat(counter=1), now=0.5)
    t.observe(1, heartbeat(counter=2, state=NodeState.REGROUPING, session=None,
                           error="the master aborted the run"), now=1.0)
    assert isinstance(t.verdict(1, now=1.0), PeerLostError)
