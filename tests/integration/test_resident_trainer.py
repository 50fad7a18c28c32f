"""The resident trainer on the real loop: one torchrun group per session; a trainer
process that dies or hangs between jobs is named within the lease and replaced;
after a lost node, training resumes from the last saved state and trains again
at most `train.save_interval - 1` iterations, from their kept batches."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.integration.test_rl_loop import CONFIG, LEASE
from tests.support.cluster import LocalCluster
from tests.support.trainers import trainer_processes

pytestmark = pytest.mark.slow
BEAT = 0.5  # CONFIG's heartbeat_interval_s: an idle trainer is pinged this often
# Every process is slowed by a loaded 2-core machine: seconds of margin beyond
# the lease for a death or a hang to show in the daemon's log.
SLACK = 5.0


def cluster(tmp_path: Path, model: Path, *, iterations: int, on_failure: str) -> LocalCluster:
    config = tmp_path / "rl.toml"
    text = CONFIG.format(model=model, iterations=iterations, lease=LEASE, on_failure=on_failure)
    config.write_text(text.replace("[train]\n", "[train]\nsave_interval = 2\n"))
    return LocalCluster(tmp_path / "run", tmp_path, num_nodes=3, config=config)


def arrival(run: Path, iteration: int, phase: int, rank: int) -> dict[str, Any]:
    path = run / f"iterations/{iteration:06d}/phase-{phase:02d}/arrive-{rank}.json"
    return json.loads(path.read_text())["payload"]


def train_metrics(run: Path, iteration: int) -> dict[str, Any]:
    return json.loads((run / f"iterations/{iteration:06d}/metrics/train.json").read_text())


def in_rollout(c: LocalCluster, rank: int, iteration: int) -> bool:
    hb = c.heartbeat(rank)
    return bool(hb and hb["iteration"] == iteration and 1 <= hb["phase"] <= 6)


def idle_trainer(c: LocalCluster, rank: int, iteration: int) -> list[psutil.Process]:
    """Rank's trainer processes once it rolls out `iteration` (its trainer idles)."""
    c.wait_until(lambda: in_rollout(c, rank, iteration) and
                 bool(trainer_processes(c.log_path, rank)), 600,
                 f"rank {rank}'s rollout of iteration {iteration}, its trainer idle")
    return trainer_processes(c.log_path, rank)


def wait_for_line(c: LocalCluster, rank: int, pattern: str, *, within: float) -> float:
    """Seconds until `pattern` shows in rank's log; fails past `within`."""
    started = time.monotonic()
    c.wait_until(lambda: re.search(pattern, c.output(rank)) is not None, within,
                 f"rank {rank} to log {pattern!r}")
    return time.monotonic() - started


def test_a_trainer_that_dies_or_hangs_between_jobs_is_named_within_the_lease_and_replaced(
    tmp_path: Path, warm_model: Path
) -> None:
    c = cluster(tmp_path, warm_model, iterations=4, on_failure="exit")
    run = c.log_path
    try:
        c.start_all()
        # Iteration 1's rollout: iteration 0 trained, the group idles. Rank 2's dies.
        (victim,) = idle_trainer(c, 2, 1)
        victim.kill()
        took = wait_for_line(c, 2, rf"resident trainer \(group [^)]+\) (lost process 0 \(pid "
                                   rf"{victim.pid}\): its connection closed|exited: torchrun).* "
                                   "between training phases", within=LEASE + SLACK)
        print(f"\na dead trainer was named after {took:.1f} s")

        # Iteration 2's rollout: rank 1's stops answering (SIGSTOP), named once a lease passes.
        (frozen,) = idle_trainer(c, 1, 2)
        frozen.send_signal(signal.SIGSTOP)
        took = wait_for_line(c, 1, rf"hung: process 0 \(pid {frozen.pid}\) has not answered "
                                   rf"for \d+ s \(lease {LEASE:g} s\)",
                             within=LEASE + 2 * BEAT + SLACK)
        print(f"a hung trainer was named after {took:.1f} s")
        c.wait_until(lambda: not psutil.pid_exists(frozen.pid)
                     or frozen.status() == psutil.STATUS_ZOMBIE, 15, "the hung trainer killed")

        codes = c.wait_all(timeout=600)
        assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-3000:] for r in codes}
    finally:
        c.close()
    # A new group where a member's trainer was gone, the same one otherwise.
    for rank in range(3):
        how = [arrival(run, it, 10, rank)["trainer"] for it in range(4)]
        assert how == ["started", "started", "started", "kept"], (rank, how)
    # No state before iteration 1 (saves at 1 and 3): the new group of iteration 1
    # started from the initial model and trained iteration 0 again, to the same weights;
    # that of iteration 2 resumed from iteration 1's state with nothing to redo.
    assert train_metrics(run, 1)["resumed"]["from_state"] is None
    assert train_metrics(run, 1)["resumed"]["replayed"] == [{"iteration": 0, "matches": True}]
    assert train_metrics(run, 2)["resumed"]["from_state"] == 1
    assert train_metrics(run, 2)["resumed"]["replayed"] == []
    assert train_metrics(run, 3)["resumed"] is None
    steps = [(train_metrics(run, it)["optimizer_step_start"],
              train_metrics(run, it)["optimizer_step_end"]) for it in range(4)]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(steps)), steps
    assert not trainer_processes(run), "every trainer stopped with its daemon"


def kill_and_restart(c: LocalCluster, rank: int, iteration: int, *, delay: float) -> None:
    """SIGKILL a whole node (daemon, engine, torchrun, trainer) as it rolls out
    `iteration`, check that its trainer went with its daemon (no orphan holds a GPU),
    then start it again alone."""
    orphans = idle_trainer(c, rank, iteration)
    c.kill(rank)
    killed = time.monotonic()
    c.wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                 for p in orphans), 10, f"rank {rank}'s trainer gone")
    print(f"rank {rank}'s trainer was gone {time.monotonic() - killed:.1f} s after its daemon")
    time.sleep(delay)
    c.start(rank)


def test_after_a_lost_node_training_resumes_from_the_saved_state_redoing_at_most_one(
    tmp_path: Path, warm_model: Path
) -> None:
    """save_interval 2: states at iterations 1 and 3, and wherever a trainer stops cleanly."""
    c = cluster(tmp_path, warm_model, iterations=4, on_failure="wait")
    run = c.log_path
    try:
        c.start_all()
        # Iteration 1: worker 2 is lost.  The survivors regroup, and the master's idle
        # trainer (DDP: trainer rank 0 holds the state) saves iteration 0's as it stops.
        kill_and_restart(c, 2, 1, delay=LEASE + 1)
        # Iteration 3: the master is lost: nobody can save for it; iteration 1's is newest.
        kill_and_restart(c, 0, 3, delay=1.0)
        codes = c.wait_all(timeout=600)
        assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-3000:] for r in codes}
    finally:
        c.close()
    assert len(json.loads((run / "recoveries.json").read_text())["recoveries"]) == 2
    # Iteration 1 went on from the state its stopping trainer saved: nothing redone.
    assert train_metrics(run, 1)["resumed"] == {
        "from_state": 0, "model": str(run / "checkpoints/iter-000000"), "replayed": []}
    # Iteration 3 trained on a new group: from iteration 1's state, iteration 2 again
    # (save_interval 2: at most one iteration redone), to the weights it had published.
    resumed = train_metrics(run, 3)["resumed"]
    assert resumed["from_state"] == 1, resumed
    assert resumed["replayed"] == [{"iteration": 2, "matches": True}], resumed
    steps = [(train_metrics(run, it)["optimizer_step_start"],
              train_metrics(run, it)["optimizer_step_end"]) for it in range(4)]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(steps)), steps
    # Every node started the new groups (the lost ones' trainers went with their daemons).
    assert [arrival(run, 3, 10, r)["trainer"] for r in range(3)] == ["started"] * 3
    # The newest complete state is the run's last; older ones were pruned.
    assert sorted(os.listdir(run / "train_state")) == ["iter-000003"]
    assert not trainer_processes(run)
