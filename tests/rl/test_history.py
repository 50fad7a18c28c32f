"""What each iteration did, read from the metrics on disk, and the verdict a
completed run ends with: exit 0 only if every iteration trained on a batch
within the failure budget (rl/history.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordinator.machine.actions import resolve_config
from rl import history, layout


def write(run: Path, iteration: int, name: str, **fields: Any) -> None:
    path = layout.metrics(run, iteration, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fields))


def iteration(run: Path, it: int, *, samples: int = 1024, kept: int = 1024, failed: int = 0,
              trained: int | None = None, eval_failed: int | None = None) -> None:
    write(run, it, "rollout", num_samples=samples, num_train_samples=kept, num_failed=failed,
          reward_mean=0.25, reward_calls=samples, reward_timeouts=4)
    if eval_failed is not None:
        write(run, it, "eval", num_samples=128, num_failed=eval_failed, accuracy=0.5,
              reward_calls=128, reward_timeouts=1)
    write(run, it, "train", samples=kept if trained is None else trained, loss=0.1)


def config(iterations: int = 2, **schedule: Any):  # type: ignore[no-untyped-def]
    return resolve_config({"run": {"iterations": iterations}, "schedule": schedule})


def test_a_run_that_trained_every_iteration_within_the_budget_summarises_and_passes(
        tmp_path: Path) -> None:
    iteration(tmp_path, 0, failed=3, kept=1000, eval_failed=2)
    iteration(tmp_path, 1)
    summary = history.summarize(tmp_path, config())
    assert summary.problem is None
    assert summary.text == "2024 samples trained, 5 failed"
    rows = history.report(tmp_path, 2)
    assert rows[0] == {"iteration": 0, "train_samples": 1000, "failed_samples": 5,
                       "rollout_samples": 1024, "reward_mean": 0.25, "eval_accuracy": 0.5,
                       "staleness_max": None, "reward_timeouts": 5, "checkpoint": None}


def test_an_iteration_that_learned_nothing_or_past_the_budget_fails_the_run(
        tmp_path: Path) -> None:
    iteration(tmp_path, 0, kept=0, trained=0)  # an empty batch, the model unchanged
    iteration(tmp_path, 1, failed=200)  # 20 % failed, limit 10 %
    problem = history.summarize(tmp_path, config()).problem
    assert problem is not None
    assert "iteration 0: an empty train batch" in problem
    assert "iteration 1: 200 of 1024 samples failed (limit rollout.max_failed_fraction=0.1)" \
        in problem


def test_missing_metrics_are_unknown_never_zero(tmp_path: Path) -> None:
    iteration(tmp_path, 0)
    (tmp_path / "iterations/000000/metrics/train.json").unlink()
    problem = history.summarize(tmp_path, config(iterations=1)).problem
    assert problem == "iteration 0: no training metrics"
    record = history.record(tmp_path, 0)
    assert record.trained is None and record.failed == 0 and record.row()["train_samples"] is None
    (tmp_path / "iterations/000000/metrics/rollout.json").write_text("{torn")
    assert history.record(tmp_path, 0).rolled_out is None
    assert history.report(tmp_path, 3) == []  # nothing readable: no rows
    # Eval's counts alone are no total while rollout.json is there but unreadable.
    write(tmp_path, 0, "eval", num_samples=128, num_failed=0, accuracy=0.5, reward_timeouts=0)
    [row] = history.report(tmp_path, 1)
    assert row["eval_accuracy"] == 0.5
    assert row["failed_samples"] is None and row["reward_timeouts"] is None, row


def test_a_run_that_asked_for_no_training_is_not_held_to_it(tmp_path: Path) -> None:
    write(tmp_path, 0, "eval", num_samples=128, num_failed=0, accuracy=0.5)
    summary = history.summarize(tmp_path, config(iterations=1, rollout_split="eval-only"))
    assert summary.problem is None and "no training asked: eval only" in summary.text
    iteration(tmp_path, 0)
    (tmp_path / "iterations/000000/metrics/train.json").unlink()
    rollout_only = history.summarize(tmp_path, config(iterations=1, rl_phase="rollout"))
    assert rollout_only.problem is None and "rollout only" in rollout_only.text


def _failing_reads(monkeypatch: Any, seconds: float,
                   succeeded: list[Path] | None = None) -> list[Path]:
    """Metrics files answer EIO from the first read of one until `seconds` later:
    a file server failing over, or a bucket throttling GETs.  Each read that
    succeeds is added to `succeeded`."""
    import errno
    import time

    from coordinator.storage import fsio

    real = fsio.read_bytes
    first: dict[str, float] = {}
    failed: list[Path] = []

    def read_bytes(path: Path, **kwargs: Any) -> bytes:
        if "metrics" in path.parts:
            started = first.setdefault("server down", time.monotonic())
            if time.monotonic() - started < seconds:
                failed.append(path)
                raise OSError(errno.EIO, "Input/output error", str(path))
            data = real(path, **kwargs)
            if succeeded is not None:
                succeeded.append(path)
            return data
        return real(path, **kwargs)

    monkeypatch.setattr(fsio, "read_bytes", read_bytes)
    return failed


def test_a_finished_run_whose_metrics_fail_to_read_for_a_while_still_exits_0(
        tmp_path: Path, monkeypatch: Any) -> None:
    from coordinator.machine.actions import completed_run, kind
    from coordinator.records.phases import Phase

    iteration(tmp_path, 0, eval_failed=0)
    iteration(tmp_path, 1)
    read: list[Path] = []
    failed = _failing_reads(monkeypatch, seconds=1.5, succeeded=read)  # past a 1 s retry
    line = completed_run(kind("rl"), tmp_path, config(), run_id="r", recoveries=0,
                         last_phase=Phase.FINAL_SYNC)  # raises PhaseFailedError (exit 4) else
    assert line == "2 iterations of run r: 2048 samples trained, 0 failed, 0 recoveries"
    assert len(failed) > 1  # the fault was hit, retried, and read through
    # Each metrics file of the run read through once, none again once it was.
    assert sorted(read) == sorted(tmp_path.glob("iterations/*/metrics/*.json")), read


def test_metrics_that_stay_unreadable_past_the_deadline_fail_the_run_naming_the_file(
        tmp_path: Path, monkeypatch: Any) -> None:
    iteration(tmp_path, 0)
    _failing_reads(monkeypatch, seconds=60)
    problem = history.summarize(tmp_path, config(iterations=1), deadline_s=0.3).problem
    assert problem is not None
    assert "iteration 0: " in problem and "rollout.json could not be read" in problem
    assert "Input/output error" in problem


def test_a_worker_started_again_on_a_finished_run_exits_as_the_run_did(tmp_path: Path) -> None:
    """No master comes to a finished run: the worker exits once rank 0 stayed still a
    lease, with the verdict its daemons gave: 4 when an iteration trained on nothing
    (it used to exit 0 saying only that the run was complete), 0 once it learned."""
    import os
    import subprocess
    import sys
    import time

    from coordinator.records import layout as records
    from coordinator.records.records import Journal, Manifest
    from coordinator.storage.store import FsStore, publish_record

    run = tmp_path / "run"
    run.mkdir()
    resolved = resolve_config({"run": {"iterations": 2},
                               "coordination": {"lease_s": 1.0, "heartbeat_interval_s": 0.5}})
    store = FsStore(run)
    manifest = Manifest(run_id="a1b2c3d4e5f6", generation=0, num_nodes=2, weights=(1.0, 1.0),
                        config=resolved.experiment(), config_hash=resolved.hash(),
                        created=time.time())
    publish_record(store, records.MANIFEST, manifest)
    for rank in (0, 1):
        publish_record(store, records.journal(rank), Journal(
            run_id=manifest.run_id, rank=rank, completed_iteration=1, iteration=2, done=()))
    iteration(run, 0, kept=0, trained=0)  # an empty batch: the run did not learn
    iteration(run, 1)

    def worker() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "coordinator_cli", "run", "--worker", "1",
                               "--run-dir", str(run)], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    failed = worker()
    assert failed.returncode == 4, failed.stdout + failed.stderr
    assert "completed, but not as asked: iteration 0: an empty train batch" in failed.stderr
    iteration(run, 0)
    learned = worker()
    assert learned.returncode == 0, learned.stdout + learned.stderr
    assert "rank 1: the run finished 2 iterations of run a1b2c3d4e5f6: 2048 samples trained" \
        in learned.stderr, learned.stderr
