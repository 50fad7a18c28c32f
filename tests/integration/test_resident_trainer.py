"""The resident trainer on the real loop: one torchrun group per session; a trainer
process that dies or hangs between jobs is named within the lease and replaced;
after a lost node, training resumes from the last saved state and trains again
at most `train.save_interval - 1` iterations, from their kept batches.  (A clean
stop that saves first: tests/rl/test_trainer_host.py.)"""

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
ITERATIONS = 5
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
                 bool(trainer_processes(c.run_dir, rank)), 600,
                 f"rank {rank}'s rollout of iteration {iteration}, its trainer idle")
    return trainer_processes(c.run_dir, rank)


def wait_for_line(c: LocalCluster, rank: int, pattern: str, *, within: float) -> float:
    """Seconds until `pattern` shows in rank's log; fails past `within`."""
    started = time.monotonic()
    c.wait_until(lambda: re.search(pattern, c.output(rank)) is not None, within,
                 f"rank {rank} to log {pattern!r}")
    return time.monotonic() - started


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


def test_a_lost_trainer_is_named_within_the_lease_and_its_replacement_redoes_at_most_one(
    tmp_path: Path, warm_model: Path
) -> None:
    """One run, save_interval 2 (states at iterations 1, 3 and the last): a trainer
    process killed between jobs (iteration 1), one that stops answering (2), and a
    lost master node under on_failure "wait" (3)."""
    c = cluster(tmp_path, warm_model, iterations=ITERATIONS, on_failure="wait")
    run = c.run_dir
    try:
        c.start_all()
        # Iteration 1's rollout: iteration 0 trained, the group idles. Rank 2's dies.
        (victim,) = idle_trainer(c, 2, 1)
        victim.kill()
        # Named by its watcher, or by phase 9 if that comes first: both between jobs.
        took = wait_for_line(c, 2, rf"resident trainer \(group [^)]+\) (lost process 0 \(pid "
                                   rf"{victim.pid}\): its connection closed|exited: torchrun).* "
                                   "(between training phases|at the training phase's start)",
                             within=LEASE + SLACK)
        print(f"\na dead trainer was named after {took:.1f} s")

        # Iteration 2's rollout: rank 1's stops answering (SIGSTOP), named once a lease passes.
        (frozen,) = idle_trainer(c, 1, 2)
        frozen.send_signal(signal.SIGSTOP)
        took = wait_for_line(c, 1, rf"hung: process 0 \(pid {frozen.pid}\) (has not answered "
                                   rf"for \d+ s \(lease {LEASE:g} s\)|did not answer a ping "
                                   rf"within the lease \({LEASE:g} s\))",
                             within=LEASE + 2 * BEAT + SLACK)
        print(f"a hung trainer was named after {took:.1f} s")
        c.wait_until(lambda: not psutil.pid_exists(frozen.pid)
                     or frozen.status() == psutil.STATUS_ZOMBIE, 15, "the hung trainer killed")

        # Iteration 3's rollout: the master node is lost.  Nobody can save its state for
        # it (under DDP trainer rank 0 holds the one shard): iteration 1's is the newest.
        kill_and_restart(c, 0, 3, delay=1.0)
        codes = c.wait_all(timeout=600)
        assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-3000:] for r in codes}
    finally:
        c.close()
    assert len(json.loads((run / "recoveries.json").read_text())["recoveries"]) == 1
    # A new group wherever a member's trainer was gone, the same one otherwise.
    for rank in range(3):
        how = [arrival(run, it, 10, rank)["trainer"] for it in range(ITERATIONS)]
        assert how == ["started"] * 4 + ["kept"], (rank, how)
    resumed = [train_metrics(run, it)["resumed"] for it in range(ITERATIONS)]
    # No state before iteration 1: the group of iteration 1 started from the initial
    # model and trained iteration 0 again, to the weights it had published.
    assert resumed[1]["from_state"] is None
    assert resumed[1]["replayed"] == [{"iteration": 0, "matches": True}]
    # Iteration 2's group resumed from iteration 1's state with nothing to redo.
    assert (resumed[2]["from_state"], resumed[2]["replayed"]) == (1, [])
    # Iteration 3's: from iteration 1's state, iteration 2 again (save_interval 2: at
    # most one iteration redone), to the weights it had published.  Rollouts, batches
    # and checkpoints were kept: only training was redone.
    assert (resumed[3]["from_state"], resumed[3]["replayed"]) == (
        1, [{"iteration": 2, "matches": True}])
    assert resumed[4] is None
    steps = [(train_metrics(run, it)["optimizer_step_start"],
              train_metrics(run, it)["optimizer_step_end"]) for it in range(ITERATIONS)]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(steps)), steps
    # The newest complete state is the run's last; older ones were pruned.
    assert sorted(os.listdir(run / "train_state")) == [f"iter-{ITERATIONS - 1:06d}"]
    assert not trainer_processes(run), "every trainer stopped with its daemon"
