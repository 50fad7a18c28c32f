"""SIGKILL a rank mid-run: survivors stop within lease + 5 s naming it; recover resumes."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.records.phases import Phase
from tests.support.cluster import LocalCluster, scripted_log, scripted_runs, write_config

pytestmark = pytest.mark.slow
LEASE = 3.0
ALL = [(it, int(p)) for it in range(3) for p in Phase]

# on_failure "exit" (the path `coordinator recover` serves): a worker in a
# rollout phase, a collective step and an engine phase, the master in an action
# of its own and in training; a worker in three more phases: SEQUENCE below.
# tests/coordinator/test_regroup.py and test_chaos.py kill at more points with
# on_failure "wait".
SCENARIOS = [(2, phase) for phase in (2, 10, 12)] + [(0, 4), (0, 10)]


def _outputs(run_dir: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in (run_dir / "iterations").glob("*/scripted/*/*.json")}


@pytest.mark.parametrize(("victim", "phase"), SCENARIOS,
                         ids=[f"rank{v}-phase{p}" for v, p in SCENARIOS])
def test_survivors_exit_naming_the_dead_rank_and_recover_resumes_the_run(
    tmp_path: Path, victim: int, phase: int
) -> None:
    # The victim's own action in iteration 1, phase K lasts 1.5 s: we kill it there.
    config = write_config(tmp_path / "c.toml", lease=LEASE,
                          scripted=f'sleeps = ["{victim}:1:{phase}:1.5"]')
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=3, config=config,
                     master_args=("--rank-weights", "2,1,1"))
    try:
        c.start_all()
        c.wait_until(lambda: c.at_phase(victim, 1, phase, "running"), 60,
                     f"rank {victim} in iteration 1 phase {phase}")
        c.kill(victim)
        killed_at = time.monotonic()
        survivors = [r for r in range(3) if r != victim]
        for rank in survivors:
            code = c.wait(rank, timeout=LEASE + 5 + 5)
            took = time.monotonic() - killed_at
            assert code == 3, c.output(rank)[-2000:]
            assert took <= LEASE + 5, f"rank {rank} needed {took:.1f} s to stop"
            assert re.search(
                rf"rank {victim} \(host [^)]+\) lost at iteration 1 phase {phase} \(", c.output(rank)
            ), c.output(rank)[-2000:]
        before = _outputs(c.run_dir)
        assert before, "some actions completed before the kill"

        # No --iteration: recover finds it from the journals and says which.
        recover = subprocess.run(
            [sys.executable, "-m", "coordinator_cli", "recover", "--run-dir", str(c.run_dir)],
            capture_output=True, text=True, timeout=60)
        assert recover.returncode == 0, recover.stderr
        assert "recovering iteration 1: the lowest iteration a journal has not completed" \
            in recover.stdout
        assert "recovery of" in recover.stdout and "at iteration 1:" in recover.stdout
        assert "generation is now 1" in recover.stdout

        c.start_all()
        codes = c.wait_all(timeout=90)
        assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-2000:] for r in codes}
        # Nothing completed before the kill was redone: same files, same mtimes,
        # and every action ran exactly once over both attempts.  The exception
        # is training (phase 10), a collective step: when one rank did not
        # finish it, every rank runs it again, together.
        redo = {(1, 10, r) for r in survivors} if phase == 10 else set()
        after = _outputs(c.run_dir)
        kept = {p: m for p, m in before.items() if "phase-10" not in p.name or phase != 10
                or "/000001/" not in str(p)}
        assert {p: after[p] for p in kept} == kept
        runs = scripted_runs(c.run_dir)
        assert {k for k, n in runs.items() if n != 1} == redo
        assert all(runs[k] == 2 for k in redo)
        for rank in range(3):
            expected = list(ALL)
            if (1, 10, rank) in redo:
                expected.insert(expected.index((1, 11)), (1, 10))
            assert scripted_log(c.run_dir, rank) == expected
    finally:
        c.close()


# The rest of the phase table: a worker in phases 0, 9 and 13, one kill after
# another in a single run, each followed by `recover` and a restart of every
# rank.  With the scenarios above (phase 4: the master's), and a worker killed
# mid-eval (phase 6) in tests/integration/test_rl_netfs.py, every phase issue 2
# names (0, 2, 4, 6, 9, 10, 12, 13) is killed in and recovered from.  No action
# is collective here, so each runs exactly once.
SEQUENCE = [(2, 0, 0), (2, 0, 9), (1, 1, 13)]


def test_one_run_killed_in_three_more_phases_recovers_each_time_and_redoes_nothing(
    tmp_path: Path,
) -> None:
    sleeps = ", ".join(f'"{v}:{it}:{p}:1.5"' for v, it, p in SEQUENCE)
    config = write_config(tmp_path / "c.toml", lease=LEASE, scripted=f"sleeps = [{sleeps}]")
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=3, config=config,
                     master_args=("--rank-weights", "2,1,1"))
    try:
        c.start_all()
        for victim, iteration, phase in SEQUENCE:
            c.wait_until(lambda v=victim, i=iteration, p=phase: c.at_phase(v, i, p, "running"),
                         60, f"rank {victim} in iteration {iteration} phase {phase}")
            c.kill(victim)
            killed_at = time.monotonic()
            for rank in (r for r in range(3) if r != victim):
                code = c.wait(rank, timeout=LEASE + 5 + 5)
                took = time.monotonic() - killed_at
                assert code == 3, c.output(rank)[-2000:]
                assert took <= LEASE + 5, f"rank {rank} needed {took:.1f} s to stop"
                assert re.search(rf"rank {victim} \(host [^)]+\) lost at iteration {iteration} "
                                 rf"phase {phase} \(", c.output(rank)), c.output(rank)[-2000:]
            recover = subprocess.run(
                [sys.executable, "-m", "coordinator_cli", "recover", "--run-dir", str(c.run_dir)],
                capture_output=True, text=True, timeout=60)
            assert recover.returncode == 0, recover.stderr
            assert f"recovering iteration {iteration}:" in recover.stdout, recover.stdout
            c.start_all()
        codes = c.wait_all(timeout=90)
        assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-2000:] for r in codes}
        assert set(scripted_runs(c.run_dir).values()) == {1}
        for rank in range(3):
            assert scripted_log(c.run_dir, rank) == ALL
    finally:
        c.close()


def test_recover_refuses_while_a_rank_still_heartbeats(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", lease=LEASE, scripted='sleeps = ["*:0:1:30"]')
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=2, config=config)
    try:
        c.start_all()
        c.wait_until(lambda: c.at_phase(1, 0, 1, "running"), 60, "rank 1 in its rollout")
        out = subprocess.run(
            [sys.executable, "-m", "coordinator_cli", "recover", "--run-dir", str(c.run_dir),
             "--iteration", "0"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2
        assert "refusing to recover while daemons still heartbeat" in out.stderr
        assert "rank 0" in out.stderr and "rank 1" in out.stderr
        dry = subprocess.run(
            [sys.executable, "-m", "coordinator_cli", "recover", "--run-dir", str(c.run_dir),
             "--iteration", "0", "--force", "--dry-run"], capture_output=True, text=True,
            timeout=60)
        assert dry.returncode == 0 and "would remove" in dry.stdout
        assert "ranks/1/claim.json" in dry.stdout, dry.stdout
        assert (c.run_dir / "ranks/1/claim.json").exists(), "a dry run removes nothing"
    finally:
        c.close()


def test_a_restart_without_recover_replaces_the_dead_claim_and_completes(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", lease=LEASE, scripted='sleeps = ["1:1:4:1.5"]')
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=3, config=config)
    try:
        c.start_all()
        c.wait_until(lambda: c.at_phase(1, 1, 4, "running"), 60, "rank 1 in iteration 1 phase 4")
        c.kill(1)
        assert c.wait(0, timeout=LEASE + 10) == 3 and c.wait(2, timeout=LEASE + 10) == 3
        # The dead daemon's claim is still there; its pid is gone on this host,
        # so the restarted rank 1 takes it over at once.
        assert (c.run_dir / "ranks/1/claim.json").exists()
        c.start_all()
        codes = c.wait_all(timeout=90)
        assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-2000:] for r in codes}
        assert "taking over rank 1 from a dead holder" in c.output(1)
        assert set(scripted_runs(c.run_dir).values()) == {1}
    finally:
        c.close()
