"""Three real `coordinator run` daemons on this machine, scripted actions."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.records.phases import Phase
from tests.support.cluster import (
    LocalCluster,
    arrivals_on_disk,
    scripted_log,
    scripted_runs,
    write_config,
)

pytestmark = pytest.mark.slow
ALL = [(it, int(p)) for it in range(3) for p in Phase]


@pytest.fixture
def cluster(tmp_path: Path):
    made: list[LocalCluster] = []

    def make(num_nodes: int = 3, *, scripted: str = "", iterations: int = 3,
             master_args: tuple[str, ...] = ("--rank-weights", "2,1,1"),
             run_dir: Path | None = None) -> LocalCluster:
        config = write_config(tmp_path / f"config{len(made)}.toml", iterations=iterations,
                              scripted=scripted)
        c = LocalCluster(run_dir or tmp_path / "run", tmp_path, num_nodes=num_nodes,
                         config=config, master_args=master_args)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_three_ranks_pass_every_phase_in_order_in_every_iteration(cluster) -> None:
    c = cluster()
    c.start_all()
    codes = c.wait_all(timeout=90)
    assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-2000:] for r in codes}
    manifest = json.loads((c.run_dir / "run.json").read_text())
    assert manifest["weights"] == [2.0, 1.0, 1.0]
    arrivals = arrivals_on_disk(c.run_dir)
    for it, phase in ALL:
        for rank in range(3):
            record = arrivals[(it, phase, rank)]
            assert record["status"] == "ok" and record["run_id"] == manifest["run_id"]
        release = json.loads(
            (c.run_dir / f"iterations/{it:06d}/phase-{phase:02d}/release.json").read_text())
        assert release["decision"] == "continue"
    for rank in range(3):
        # Each rank executed every action exactly once, in phase order.
        assert scripted_log(c.run_dir, rank) == ALL
        journal = json.loads((c.run_dir / f"ranks/{rank}/journal.json").read_text())
        assert journal["completed_iteration"] == 2
        # A finished daemon gives its rank back.
        assert not (c.run_dir / f"ranks/{rank}/claim.json").exists()
    assert set(scripted_runs(c.run_dir).values()) == {1}
    # The phase-9 release says whether the collective phase 10 runs: every rank
    # runs it the first time.
    release9 = json.loads((c.run_dir / "iterations/000000/phase-09/release.json").read_text())
    assert release9["payload"]["run"] == {"10": True}


def test_worker_started_before_master_waits_visibly_then_proceeds(cluster) -> None:
    c = cluster(iterations=1)
    c.start(1)
    c.start(2)
    c.wait_until(lambda: "waiting for the master" in c.output(1), 20,
                 "worker 1 to say it waits for the master")
    assert c.procs[1].poll() is None
    c.start(0)
    assert c.wait_all(timeout=60) == {0: 0, 1: 0, 2: 0}


def test_second_daemon_for_a_held_rank_exits_2_naming_the_holder(cluster, tmp_path) -> None:
    # Rank 1 stays 6 s in its first rollout: the second daemon (seconds of imports
    # on a loaded machine) must find the run going on, not completed (it would
    # rightly exit 0 then, coordinator/machine/finished.py).
    c = cluster(iterations=2, scripted='sleeps = ["1:0:1:6.0"]')
    c.start_all()
    c.wait_until(lambda: c.at_phase(1, 0, 1), 30, "worker 1 in its first rollout")
    second = subprocess.run(c.command(1), capture_output=True, text=True, timeout=60)
    assert second.returncode == 2, second.stderr
    holder = c.procs[1].pid
    assert f"already held by pid {holder} on host" in second.stderr
    assert c.wait_all(timeout=60) == {0: 0, 1: 0, 2: 0}


def test_records_of_an_earlier_run_in_the_same_log_path_are_ignored(cluster, tmp_path) -> None:
    old = cluster(iterations=1, run_dir=tmp_path / "old")
    old.start_all()
    assert old.wait_all(timeout=60) == {0: 0, 1: 0, 2: 0}
    old_run = json.loads((old.run_dir / "run.json").read_text())["run_id"]
    # Leave every record of that run in a run directory, except its manifest, plus
    # claims that look held and a master heartbeat that looks alive.
    planted = tmp_path / "new"
    shutil.copytree(old.run_dir, planted)
    (planted / "run.json").unlink()
    for rank in range(3):
        claim = {"schema": "coordinator/claim", "version": 1, "run_id": old_run, "generation": 0,
                 "rank": rank, "token": f"old{rank}", "host": "gone-host", "address": "10.9.9.9",
                 "probe_port": 1, "pid": 1, "started": 0.0}
        (planted / f"ranks/{rank}/claim.json").write_text(json.dumps(claim))
    new = cluster(iterations=1, run_dir=planted)
    new.start(1)
    new.start(2)
    time.sleep(1.5)  # the workers look at the stale master's records first
    new.start(0)
    assert new.wait_all(timeout=60) == {0: 0, 1: 0, 2: 0}, new.output(1)
    run_id = json.loads((planted / "run.json").read_text())["run_id"]
    assert run_id != old_run
    for record in arrivals_on_disk(planted).values():
        assert record["run_id"] == run_id
    assert "10.9.9.9" not in new.output(1)


def test_failed_action_aborts_every_rank_naming_rank_phase_and_cause(cluster) -> None:
    c = cluster(scripted='fail = ["2:1:6"]')
    c.start_all()
    codes = c.wait_all(timeout=60)
    assert codes == {0: 4, 1: 4, 2: 4}, {r: c.output(r)[-1500:] for r in codes}
    for rank in range(3):
        out = c.output(rank)
        assert re.search(r"rank 2 .*failed iteration 1 phase 6 \(eval\).*injected failure", out), out
    release = json.loads((c.run_dir / "iterations/000001/phase-06/release.json").read_text())
    assert release["decision"] == "abort" and "injected failure" in release["abort"]["reason"]
    # The failed action posted no success record.
    assert arrivals_on_disk(c.run_dir)[(1, 6, 2)]["status"] == "failed"


def test_sigterm_makes_a_daemon_leave_and_peers_stop_without_waiting_for_the_lease(cluster) -> None:
    c = cluster(scripted='sleeps = ["*:1:1:20"]')
    c.start_all()
    c.wait_until(lambda: c.at_phase(2, 1, 1, "running"), 40, "worker 2 in iteration 1 rollout")
    sent = time.monotonic()
    c.procs[2].send_signal(signal.SIGTERM)
    codes = c.wait_all(timeout=30)
    took = time.monotonic() - sent
    assert codes[2] == 130
    assert codes[0] == 3 and codes[1] == 3, {r: c.output(r)[-1500:] for r in codes}
    assert took < 3.0, f"peers took {took:.1f} s; a departure must not wait for the 3 s lease"
    assert "rank 2 (host" in c.output(0) and "left" in c.output(0)
    hb = c.heartbeat(2)
    assert hb is not None and hb["state"] == "left"


def test_module_entry_point_prints_help() -> None:
    out = subprocess.run([sys.executable, "-m", "coordinator_cli", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "recover" in out.stdout and "status" in out.stdout


def test_status_shows_every_rank_what_it_waits_for_and_the_last_error(cluster) -> None:
    c = cluster(scripted='sleeps = ["2:0:1:30"]')
    c.start_all()
    c.wait_until(lambda: c.at_phase(2, 0, 1, "running"), 40, "rank 2 in its rollout")

    def status() -> dict:
        out = subprocess.run([sys.executable, "-m", "coordinator_cli", "status", "--run-dir",
                              str(c.run_dir), "--json"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    c.wait_until(lambda: "rank 2 at iteration 0 phase 1" in
                 status()["ranks"][0]["waiting_for"], 20, "the master's waiting_for")
    report = status()
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2]
    assert [r["state"] for r in report["ranks"]] == ["waiting", "waiting", "running"]
    assert all(r["host"] and r["heartbeat_age_s"] < 3 for r in report["ranks"])
    assert report["ranks"][0]["address"] != "-"
    table = subprocess.run([sys.executable, "-m", "coordinator_cli", "status", "--run-dir",
                            str(c.run_dir)], capture_output=True, text=True, timeout=60).stdout
    assert "waiting for" in table and "rollout" in table
    c.kill(2)
    c.wait_all(timeout=20)
    report = status()
    assert report["ranks"][0]["state"] == "failed"
    assert "rank 2 (host" in report["last_error"] and "lost" in report["last_error"]


def test_a_master_killed_while_the_group_forms_stops_the_waiting_worker_after_one_lease(
    cluster,
) -> None:
    c = cluster()
    c.start(0)
    c.start(1)  # rank 2 never comes: the master keeps waiting for it
    c.wait_until(lambda: (c.heartbeat(1) or {}).get("state") == "starting", 30,
                 "worker 1 to join and wait for the group")
    c.kill(0)
    killed = time.monotonic()
    assert c.wait(1, timeout=30) == 3
    assert time.monotonic() - killed < 3.0 + 5  # lease 3 s
    assert "the master's heartbeat has not advanced" in c.output(1)
