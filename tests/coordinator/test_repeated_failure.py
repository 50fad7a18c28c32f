"""A step that fails the same way max_attempts times stops the run (exit 4) under
every on_failure; a lost rank is not such a failure.  Scripted daemons, and the
pure decision from the recovery log (coordinator/machine/regroup.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from coordinator.errors import PeerLostError, PhaseFailedError
from coordinator.machine.regroup import (
    Incident,
    Recovery,
    RecoveryLog,
    RepeatedFailure,
    fault_of,
    repeated_failure,
)
from tests.support.cluster import LocalCluster, write_config


def step_failed(rank: int, cause: str, iteration: int = 1, phase: int = 1) -> PhaseFailedError:
    return PhaseFailedError(f"rank {rank} (host gpu-0{rank}) failed iteration {iteration} "
                            f"phase {phase}: {cause}", rank=rank, iteration=iteration,
                            phase=phase, cause=cause)


def test_a_faults_signature_ignores_ranks_counts_ports_prompts_and_tracebacks() -> None:
    a = step_failed(0, "ActionError: rank 0: 688 of 688 train samples failed (limit "
                    "rollout.max_failed_fraction=0.1); first: task reverse/train/000061: "
                    "HttpError: HTTP 400 from http://127.0.0.1:33775/v1/completions: "
                    '{"error": {"message": "prompt of 5 tokens"}} prompt \'960>\'')
    b = step_failed(2, "ActionError: rank 2: 680 of 680 train samples failed (limit "
                    "rollout.max_failed_fraction=0.1); first: task reverse/train/000078: "
                    "HttpError: HTTP 400 from http://127.0.0.1:55297/v1/completions: "
                    '{"error": {"message": "prompt of 4 tokens"}} prompt \'48>\'\n  File x, '
                    "line 12")
    assert fault_of(a) == fault_of(b) != ""
    assert fault_of(step_failed(0, "ActionError: the reward raised KeyError")) != fault_of(a)
    assert fault_of(PeerLostError("rank 2 lost", rank=2)) == ""


def incident(error: PhaseFailedError | PeerLostError, iteration: int = 1,
             phase: int = 1) -> Incident:
    return Incident(rank=0, host="gpu-00", iteration=iteration, phase=phase, cause=str(error),
                    detected_by=0, detected_at=0.0, fault=fault_of(error))  # type: ignore[arg-type]


def recorded(number: int, seen: Incident) -> Recovery:
    return Recovery(number=number, rank=seen.rank, host=seen.host, iteration=seen.iteration,
                    phase=seen.phase, cause=seen.cause, detected_by=0, detected_at=0.0,
                    resumed_at=0.0, resumed_after_s=1.0, resume_iteration=seen.iteration,
                    pending={}, members={"0": "gpu-00"}, left_out=(), fault=seen.fault)


def test_the_same_step_failing_the_same_way_stops_at_max_attempts() -> None:
    first = incident(step_failed(0, "ActionError: the agent raised ValueError: boom"))
    log = RecoveryLog(run_id="r", recoveries=(recorded(1, first),))
    again = incident(step_failed(2, "ActionError: the agent raised ValueError: boom"))
    stop = repeated_failure(log, again, max_attempts=2)
    assert isinstance(stop, RepeatedFailure) and stop.exit_code == 4
    assert "iteration 1 phase 1 (rollout) failed the same way 2 times" in str(stop)
    assert "coordination.max_attempts=2" in str(stop) and "fix the cause" in str(stop)
    assert repeated_failure(log, again, max_attempts=3) is None
    # Another step, another cause, or a lost rank: not a repeat.
    assert repeated_failure(log, incident(step_failed(0, "ActionError: boom"), iteration=2),
                            max_attempts=2) is None
    assert repeated_failure(log, incident(step_failed(0, "ActionError: other")),
                            max_attempts=2) is None
    assert repeated_failure(log, incident(PeerLostError("lost", rank=1)), max_attempts=1) is None
    assert isinstance(repeated_failure(RecoveryLog(run_id="r", recoveries=()), first,
                                       max_attempts=1), RepeatedFailure)


@pytest.mark.slow
@pytest.mark.parametrize(("on_failure", "attempts"), [("wait", 2), ("shrink", 2), ("wait", 3)])
def test_a_deterministic_failure_ends_the_run_with_exit_4_on_every_node(
        tmp_path: Path, on_failure: str, attempts: int) -> None:
    config = write_config(tmp_path / "c.toml", iterations=3, scripted='fail = ["1:1:4"]',
                          on_failure=on_failure)
    config.write_text(config.read_text().replace(
        'on_failure = "', f'max_attempts = {attempts}\non_failure = "', 1))
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=3, config=config)
    started = time.monotonic()
    try:
        c.start_all()
        # Each attempt: the failure, the regroup (every rank back out of the
        # session within a heartbeat or two), a new session; seconds each.
        codes = c.wait_all(timeout=60 * attempts)
    finally:
        c.close()
    took = time.monotonic() - started
    assert codes == {0: 4, 1: 4, 2: 4}, {r: c.output(r)[-2000:] for r in codes}
    assert f"failed the same way {attempts} times" in c.output(0)
    for rank in (1, 2):
        assert "stopped for good" in c.output(rank) and "injected failure" in c.output(rank)
    recoveries = json.loads((c.run_dir / "recoveries.json").read_text())["recoveries"]
    assert len(recoveries) == attempts - 1
    assert all(r["iteration"] == 1 and r["phase"] == 4 and r["fault"] for r in recoveries)
    assert took < 40 * attempts


@pytest.mark.slow
def test_max_recoveries_holds_for_failures_that_are_not_repeats(tmp_path: Path) -> None:
    # Two different steps fail once each: neither is a repeat, but the second
    # would be recovery 2 of a run allowed 1.
    config = write_config(tmp_path / "c.toml", iterations=3,
                          scripted='fail_once = ["1:0:4", "2:1:6"]', on_failure="wait")
    config.write_text(config.read_text().replace(
        'on_failure = "', 'max_recoveries = 1\non_failure = "', 1))
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=3, config=config)
    try:
        c.start_all()
        codes = c.wait_all(timeout=90)
    finally:
        c.close()
    assert codes == {0: 4, 1: 4, 2: 4}, {r: c.output(r)[-2000:] for r in codes}
    assert "coordination.max_recoveries=1 recoveries already made" in c.output(0)
    recoveries = json.loads((c.run_dir / "recoveries.json").read_text())["recoveries"]
    assert [(r["iteration"], r["phase"]) for r in recoveries] == [(0, 4)]
