"""coordination.on_failure "shrink": the group goes on without a lost worker and
takes it back at an iteration boundary once it is restarted.

One scripted run of 3 daemons: rank 2 is SIGKILLed inside a 1.5 s action of
iteration 1 and not restarted.  After shrink_after_s the master forms a
session of ranks 0 and 1, which finish iteration 1 and go on.  Rank 2 is then
restarted with its original command and taken back between two iterations:
it never runs an iteration the others completed without it.  The RL loop's
side (tasks re-sharded, training on fewer nodes) is tests/integration/test_rl_shrink.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.ops.status import collect, render
from coordinator.records.phases import Phase
from tests.coordinator.test_regroup import recoveries
from tests.support.cluster import LocalCluster, scripted_log, scripted_runs, write_config

pytestmark = pytest.mark.slow
LEASE = 3.0
SHRINK_AFTER_S = 2.0
ITERATIONS = 9
KILLED_AT = (1, 1)  # iteration, phase
# Each iteration takes >= 1 s (the master sleeps in phase 5), so the restarted
# rank 2 (imports ~1.5 s on a loaded machine) finds the run still going.
SCRIPT = f'sleeps = ["2:{KILLED_AT[0]}:{KILLED_AT[1]}:1.5", "0:*:5:1.0"]'


def session(run_dir: Path) -> dict:
    return json.loads((run_dir / "session.json").read_text())  # type: ignore[no-any-return]


def timings(run_dir: Path, rank: int) -> list[int]:
    return sorted(int(p.parent.parent.name) for p in (run_dir / "iterations").glob(
        f"*/timings/rank-{rank}.json"))


def test_a_lost_worker_is_left_out_then_taken_back_at_an_iteration_boundary(
        tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", iterations=ITERATIONS, lease=LEASE,
                          scripted=SCRIPT, on_failure="shrink")
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=3, config=config,
                     master_args=["--set", f"coordination.shrink_after_s={SHRINK_AFTER_S}",
                                  "--min-nodes", "2"])
    try:
        c.start_all()
        c.wait_until(lambda: c.at_phase(2, *KILLED_AT, "running"), 120, "rank 2 in phase 1")
        c.kill(2)
        # Lease (3 s) to notice, shrink_after_s (2 s), then the group goes on:
        # the master records the recovery, then publishes the new session.
        c.wait_until(lambda: len(recoveries(c.run_dir)) == 1 and
                     sorted(session(c.run_dir)["members"]) == ["0", "1"], 60, "the shrunk group")
        shrunk = session(c.run_dir)
        assert shrunk["start_iteration"] == KILLED_AT[0]
        c.wait_until(lambda: c.at_phase(0, KILLED_AT[0] + 1, 5), 60, "iteration 2 without 2")
        for rank in (0, 1):
            assert c.procs[rank].poll() is None, c.output(rank)[-2000:]
        shown = " ".join(render(collect(c.run_dir)).split())
        assert "going on without rank(s) [2] (on_failure shrink)" in shown
        assert "without rank(s) [2] (their unfinished tasks go to the others)" in shown
        c.start(2)
        codes = c.wait_all(timeout=120)
        assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-3000:] for r in codes}
    finally:
        c.close()

    # Taking rank 2 back is no failure: nobody took the master for gone meanwhile.
    assert "to re-form the group: no reason given" not in c.output(1), c.output(1)[-3000:]
    (recovery,) = recoveries(c.run_dir)
    assert recovery["rank"] == 2 and recovery["left_out"] == [2], recovery
    assert recovery["members"].keys() == {"0", "1"}
    assert recovery["resume_iteration"] == KILLED_AT[0]
    assert session(c.run_dir)["members"].keys() == {"0", "1", "2"}

    # Rank 2 came back between two iterations: none of the ones the others did
    # without it, every phase of every one after it.
    back = min(it for it in timings(c.run_dir, 2) if it > KILLED_AT[0])
    assert back >= KILLED_AT[0] + 2
    assert timings(c.run_dir, 2) == [0, *range(back, ITERATIONS)]
    log2 = scripted_log(c.run_dir, 2)
    assert log2 == [(0, int(p)) for p in Phase] + [(1, 0)] + [
        (it, int(p)) for it in range(back, ITERATIONS) for p in Phase]
    journal = json.loads((c.run_dir / "ranks" / "2" / "journal.json").read_text())
    assert journal["completed_iteration"] == ITERATIONS - 1

    # The survivors did every phase of every iteration exactly once: nothing was
    # redone, nothing skipped (rank 2's killed action was never finished by it).
    runs = scripted_runs(c.run_dir)
    for rank in (0, 1):
        assert scripted_log(c.run_dir, rank) == [
            (it, int(p)) for it in range(ITERATIONS) for p in Phase]
    assert all(n == 1 for n in runs.values()), {k: n for k, n in runs.items() if n != 1}


def test_a_rank_back_during_the_last_iteration_exits_0_when_the_run_completes(
        tmp_path: Path) -> None:
    """No boundary is left to take it back at: the master completes the run without
    it, and the waiting rank exits 0 saying so (a requeue loop must not restart it)."""
    last = 2
    config = write_config(tmp_path / "c.toml", iterations=last + 1, lease=LEASE,
                          scripted=f'sleeps = ["2:{last}:1:1.5", "0:{last}:5:4.0"]',
                          on_failure="shrink")
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=3, config=config,
                     master_args=["--set", f"coordination.shrink_after_s={SHRINK_AFTER_S}"])
    try:
        c.start_all()
        c.wait_until(lambda: c.at_phase(2, last, 1, "running"), 120, "rank 2 in phase 1")
        c.kill(2)
        c.wait_until(lambda: len(recoveries(c.run_dir)) == 1 and
                     sorted(session(c.run_dir)["members"]) == ["0", "1"], 60, "the shrunk group")
        c.start(2)
        codes = c.wait_all(timeout=120)
        assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-3000:] for r in codes}
    finally:
        c.close()
    assert f"completed run {session(c.run_dir)['run_id']} without rank 2" in c.output(2)
    assert timings(c.run_dir, 2) == list(range(last))


def test_fewer_nodes_back_than_min_nodes_stop_every_daemon_with_exit_3(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", iterations=3, lease=LEASE,
                          scripted='sleeps = ["2:0:1:1.5"]', on_failure="shrink")
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=3, config=config,
                     master_args=["--set", f"coordination.shrink_after_s={SHRINK_AFTER_S}",
                                  "--min-nodes", "3"])
    try:
        c.start_all()
        c.wait_until(lambda: c.at_phase(2, 0, 1, "running"), 120, "rank 2 in phase 1")
        c.kill(2)
        codes = {r: c.wait(r, 60) for r in (0, 1)}
    finally:
        c.close()
    assert codes == {0: 3, 1: 3}, {r: c.output(r)[-3000:] for r in codes}
    assert "only 2 of 3 nodes are back" in c.output(0)
    assert "coordination.min_nodes=3 needs 3" in c.output(0)
    assert "coordination.min_nodes=3" in c.output(1)  # the worker says why the master stopped


def test_recover_after_a_shrink_resumes_where_it_says_without_the_left_out_rank_pulling_back(
        tmp_path: Path) -> None:
    """Rank 2 is lost in iteration 1 and the group goes on without it; rank 1's step
    then fails in iteration 2 (max_attempts 1: the run stops, exit 4).  `recover`
    names iteration 2, and a restart of every node resumes there: rank 2, left out
    since iteration 1, no longer takes the group back into iteration 1, whose
    training (a collective step) every rank would run again and, in the RL loop,
    from a checkpoint phase 13 had pruned; it rejoins at the end of iteration 2,
    whose training the others had done without it."""
    fails_at = (2, int(Phase.RESTART_ENGINE))
    config = write_config(
        tmp_path / "c.toml", iterations=4, lease=LEASE, on_failure="shrink",
        scripted=(f'sleeps = ["2:{KILLED_AT[0]}:{KILLED_AT[1]}:1.5"]\n'
                  f'fail_once = ["1:{fails_at[0]}:{fails_at[1]}"]'))
    settings = ["--set", "coordination.max_attempts=1", "--min-nodes", "2"]
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=3, config=config,
                     master_args=[*settings, "--set",
                                  f"coordination.shrink_after_s={SHRINK_AFTER_S}"])
    try:
        c.start_all()
        c.wait_until(lambda: c.at_phase(2, *KILLED_AT, "running"), 120, "rank 2 in phase 1")
        c.kill(2)
        # Lease (3 s), shrink_after_s (2 s), two iterations and the failure's stop.
        codes = {r: c.wait(r, 90) for r in (0, 1)}
        assert codes == {0: 4, 1: 4}, {r: c.output(r)[-3000:] for r in codes}
        assert "failed the same way 1 times" in c.output(0), c.output(0)[-3000:]
        assert sorted(session(c.run_dir)["members"]) == ["0", "1"]

        recover = subprocess.run(
            [sys.executable, "-m", "coordinator_cli", "recover", "--run-dir", str(c.run_dir)],
            capture_output=True, text=True, timeout=60)
        assert recover.returncode == 0, recover.stderr
        assert f"recovering iteration {fails_at[0]}:" in recover.stdout, recover.stdout
        assert f"at iteration {fails_at[0]}:" in recover.stdout, recover.stdout

        # A restart after a failure may shrink too: shrink_after_s (operational)
        # long enough for every daemon to start on a loaded machine.
        c.master_args = [*settings, "--set", "coordination.shrink_after_s=60"]
        c.start_all()
        codes = c.wait_all(timeout=120)
        assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-3000:] for r in codes}
    finally:
        c.close()

    # The group resumed where recover said, without rank 2: its members had done
    # most of iteration 2 without it.  It took rank 2 back at the next boundary.
    assert "group formed: ranks [0, 1] on hosts" in c.output(0), c.output(0)[-3000:]
    assert f"iterations {fails_at[0]}..3" in c.output(0)
    assert "rank(s) [2] rejoin the group at the end of iteration 2" in c.output(0)
    assert sorted(session(c.run_dir)["members"]) == ["0", "1", "2"]
    assert "rank 2 rejoins the group at iteration 3" in c.output(2), c.output(2)[-3000:]
    # Nothing finished was redone (training included), nothing skipped: ranks 0
    # and 1 ran every action once (rank 1's failed one raised before its record).
    for rank in (0, 1):
        assert scripted_log(c.run_dir, rank) == [(it, int(p)) for it in range(4) for p in Phase]
    assert all(n == 1 for n in scripted_runs(c.run_dir).values()), scripted_runs(c.run_dir)
    # Rank 2: iteration 0, the start of the one it was killed in, then the last.
    assert scripted_log(c.run_dir, 2) == [(0, int(p)) for p in Phase] + [(1, 0)] + [
        (3, int(p)) for p in Phase]
