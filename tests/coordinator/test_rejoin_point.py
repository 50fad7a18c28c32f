"""Where a re-formed group starts, and who joins it there: the pure decisions of
coordinator/machine/regroup.py after a shrink (start_iteration, rejoin_later).  The
multi-process run (kill, shrink, a failed step, recover, restart) is
tests/coordinator/test_shrink.py."""

from __future__ import annotations

from coordinator.machine.regroup import rejoin_later, start_iteration
from coordinator.records.records import Heartbeat, NodeState, Session

PHASES = 14


def beat(rank: int, resume: int) -> Heartbeat:
    return Heartbeat(run_id="r", generation=1, rank=rank, token=f"t{rank}", host="h", pid=1,
                     counter=1, state=NodeState.STARTING, iteration=0, phase=0, waiting_for="",
                     arrived=None, released=None, session=None, resume_iteration=resume,
                     abort=None, error=None, wall_time=1.0)


def shrunk(generation: int = 0) -> Session:
    """The session ranks 0 and 1 went on with, rank 2 left out in iteration 1."""
    return Session(run_id="r", generation=generation, session="s", start_iteration=1,
                   end_iteration=4, members={"0": "a", "1": "b"})


def test_a_rank_left_out_does_not_pull_the_group_back_whatever_the_generation() -> None:
    beats = {0: beat(0, 2), 1: beat(1, 2), 2: beat(2, 1)}
    # `coordinator recover` bumps the generation and keeps session.json.
    assert start_iteration(beats, shrunk(generation=0)) == 2
    assert start_iteration(beats, shrunk(generation=1)) == 2
    # No session on record (a new run, or one from before): every rank counts.
    assert start_iteration(beats, None) == 1


def test_a_rank_left_out_waits_for_the_end_of_an_iteration_the_others_worked_on() -> None:
    done_most = {"0": (13,), "1": (12, 13)}
    assert rejoin_later([0, 1, 2], shrunk(), pending=done_most, phases=PHASES,
                        min_nodes=1) == (2,)
    # At a boundary (nothing of the iteration done yet) it joins at once.
    untouched = {"0": tuple(range(PHASES)), "1": tuple(range(PHASES))}
    assert rejoin_later([0, 1, 2], shrunk(), pending=untouched, phases=PHASES,
                        min_nodes=1) == ()
    # Every rank was in the last session: nobody waits.
    assert rejoin_later([0, 1], shrunk(), pending=done_most, phases=PHASES, min_nodes=1) == ()
    assert rejoin_later([0, 1, 2], None, pending=done_most, phases=PHASES, min_nodes=1) == ()


def test_a_rank_left_out_joins_at_once_when_the_others_alone_are_below_min_nodes() -> None:
    # Rank 1 did not come back: ranks 0 and 2 are all there is, and min_nodes is 2.
    assert rejoin_later([0, 2], shrunk(), pending={"0": (13,)}, phases=PHASES,
                        min_nodes=2) == ()
    assert rejoin_later([0, 2], shrunk(), pending={"0": (13,)}, phases=PHASES,
                        min_nodes=1) == (2,)
