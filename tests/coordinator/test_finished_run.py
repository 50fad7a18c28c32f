"""A finished run stays finished (coordinator/machine/finished.py): every node started again
on it with the same settings exits 0 at once, saying so, and a raised
--iterations still extends it.  The worker's pure decision, then real daemons."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coordinator.errors import RunCompleted
from coordinator.machine.finished import Verdict, WorkerWatch
from coordinator.machine.membership import wait_for_session
from coordinator.machine.polling import Backoff
from coordinator.records import layout
from coordinator.records.phases import Phase
from coordinator.records.records import Heartbeat, NodeState
from coordinator.storage.store import MemoryStore, publish_record
from tests.support.cluster import LocalCluster, scripted_log, write_config

LEASE = 3.0


def master(token: str, counter: int, state: NodeState) -> Heartbeat:
    return Heartbeat(run_id="r", generation=0, rank=0, token=token, host="h", pid=1,
                     counter=counter, state=state, iteration=1, phase=13, waiting_for="",
                     arrived=None, released=None, session=None, resume_iteration=2,
                     abort=None, error=None, wall_time=1.0)


def judge(watch: WorkerWatch | None, hb: Heartbeat | None, now: float,
          finished: bool = True) -> tuple[WorkerWatch | None, Verdict]:
    return WorkerWatch.judge(watch, finished=finished, master=hb, now=now, grace_s=LEASE)


def test_a_worker_exits_once_a_new_master_finished_or_rank_0_stayed_still_for_a_lease() -> None:
    old = master("a", 9, NodeState.FINISHED)
    watch, verdict = judge(None, old, 0.0)
    assert verdict is Verdict.WAIT
    # Nobody restarts the master: its old heartbeat stays as it was for a lease.
    assert judge(watch, old, LEASE - 0.1)[1] is Verdict.WAIT
    assert judge(watch, old, LEASE)[1] is Verdict.FINISHED
    # A requeue: the master restarted (a new token), found the run complete, finished.
    starting, _ = judge(watch, master("b", 1, NodeState.STARTING), 1.0)
    assert starting is not None and judge(starting, master("b", 2, NodeState.STARTING),
                                          1.0 + LEASE - 0.1)[1] is Verdict.WAIT
    assert judge(starting, master("b", 3, NodeState.FINISHED), 1.5)[1] is Verdict.FINISHED
    # Seen starting at the first look, then finished: the same incarnation, done.
    first, _ = judge(None, master("b", 1, NodeState.STARTING), 0.0)
    assert judge(first, master("b", 2, NodeState.FINISHED), 0.5)[1] is Verdict.FINISHED


def test_a_worker_keeps_waiting_while_the_run_is_not_finished_or_rank_0_beats() -> None:
    # run.json raised (a master extends the run): the usual wait, whatever rank 0 says.
    assert judge(None, master("a", 9, NodeState.FINISHED), 0.0, finished=False) == (
        None, Verdict.WAIT)
    watch, _ = judge(None, None, 0.0)
    # A master that beats (it is about to finish, or a stale one's last beats) is
    # watched until it finishes or stops changing.
    for t in range(1, 10):
        watch, verdict = judge(watch, master("b", t, NodeState.RUNNING), float(t))
        assert verdict is Verdict.WAIT
    assert judge(watch, master("b", 9, NodeState.RUNNING), 9.0 + LEASE)[1] is Verdict.FINISHED


@pytest.mark.parametrize(("session", "message"), [
    # Restarted on a complete run, the master exits before forming any group.
    (None, "run r was already complete: the master (pid 1 on h), started again, found every "
           "iteration done, so rank 1 has nothing to do"),
    # It formed a group without this rank (left out of a shrunk group) and completed it.
    ("s1", "the master (pid 1 on h) completed run r without rank 1"),
])
def test_a_worker_that_joined_a_finishing_master_says_why_there_is_nothing_to_do(
        session: str | None, message: str) -> None:
    store = MemoryStore()
    hb = master("a", 5, NodeState.FINISHED)
    publish_record(store, layout.heartbeat(0), Heartbeat(**{**vars(hb), "session": session}))
    with pytest.raises(RunCompleted, match=re.escape(message)):
        wait_for_session(store, rank=1, token="w", run_id="r", generation=0, master_token="a",
                         join_timeout_s=5, backoff=Backoff(initial_s=0.01, factor=1.0,
                                                           ceiling_s=0.01),
                         progress_interval_s=5, retry_s=0, lease_s=LEASE)


@pytest.mark.slow
def test_every_node_started_again_on_a_finished_run_exits_0_and_more_iterations_extend_it(
        tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", iterations=2, lease=LEASE)
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=2, config=config)
    # TEST_CONFIG's join timeout is 60 s: a node that waited for the other would
    # still be waiting after these deadlines (start, imports, a lease).
    at_once = 30
    try:
        c.start_all()
        assert c.wait_all(timeout=90) == {0: 0, 1: 0}, c.output(0)[-3000:]

        # The master alone, with the same command: it says so and exits at once.
        c.start(0)
        assert c.wait(0, timeout=at_once) == 0, c.output(0)[-3000:]
        assert "is already complete: the master's journal (ranks/0/journal.json) completed " \
               "its 2 iterations" in c.output(0), c.output(0)[-3000:]
        assert "waiting for rank" not in c.output(0)
        assert "finished 2 iterations of run" in c.output(0)

        # A worker alone: no master comes; it exits once rank 0 stayed still a lease.
        c.start(1)
        assert c.wait(1, timeout=at_once) == 0, c.output(1)[-3000:]
        assert "no master is running it, so rank 1 has nothing to do" in c.output(1)
        # ...with the run's verdict, as its daemons gave it (a run that did not learn: 4).
        assert "rank 1: the run finished 2 iterations of run" in c.output(1), c.output(1)[-2000:]
        assert "error" not in c.output(1).lower(), c.output(1)[-3000:]

        # Every node at once (a requeue of the whole job) passed on 59f1c69 too: the
        # master formed a session starting at the end.  A worker that sees the
        # restarted master finish exits at once: the pure decision's test above.

        # A raised --iterations extends it: only the new iteration runs.
        c.master_args = ["--iterations", "3"]
        c.start(0)
        c.wait_until(lambda: (c.heartbeat(0) or {}).get("state") == "starting", 60,
                     "the master of the extended run")
        c.start(1)
        assert c.wait_all(timeout=90) == {0: 0, 1: 0}, {r: c.output(r)[-3000:] for r in (0, 1)}
    finally:
        c.close()
    for rank in (0, 1):
        assert scripted_log(c.run_dir, rank) == [(it, int(p)) for it in range(3) for p in Phase]
