"""The rerun after a failed rollout redoes every failed sample: an agent whose every
episode fails until the run records a recovery (a transient fault) fails phase 1 past the budget, the
group regroups, the rerun redoes those groups, and the run completes having trained
on no failed sample."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.integration.usage import ROOT, run_nodes

pytestmark = pytest.mark.slow


def test_a_transient_failure_is_redone_by_the_rerun_and_the_run_completes(
        tmp_path: Path, tiny_model: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(tiny_model, run / "model-init")
    agent = ["--set", "rollout.agent=tests.integration.broken_plugins:FlakyAgent"]
    quick = [a for s in ("coordination.heartbeat_interval_s=0.5", "coordination.lease_s=4",
                         "rollout.tasks_per_iteration=8", "rollout.group_size=4",
                         "train.mini_batch_size=0", "schedule.eval_before_train=false",
                         "rollout.keep_rank_files=true")
             for a in ("--set", s)]
    commands = [
        ["coordinator", "run", "--master", "--num-nodes", "2", "--run-dir", str(run),
         "--iterations", "1", *quick, *agent],
        ["coordinator", "run", "--worker", "1", "--run-dir", str(run), *agent],
    ]
    done = run_nodes(commands, cwd=tmp_path, timeout_s=240,
                     env={"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                          "FLAKY_UNTIL": str(run / "recoveries.json")})
    assert done.codes == {0: 0, 1: 0}, {r: t[-3000:] for r, t in done.logs.items()}
    recoveries = json.loads((run / "recoveries.json").read_text())["recoveries"]
    assert [(r["iteration"], r["phase"]) for r in recoveries] == [(0, 1)]
    assert "a flaky tool timed out" in recoveries[0]["cause"]
    # The first attempt saved its failed samples; the rerun redid them all.
    rollout = json.loads((run / "iterations/000000/metrics/rollout.json").read_text())
    assert rollout["num_samples"] == 32 and rollout["num_failed"] == 0
    for rank in (0, 1):
        manifest = json.loads((run / f"iterations/000000/rollout/rank-{rank}/manifest.json")
                              .read_text())
        assert manifest["complete"] and all(c["failed_samples"] == 0 for c in manifest["chunks"])
    train = json.loads((run / "iterations/000000/metrics/train.json").read_text())
    assert train["samples"] == 32
    for log in done.logs.values():
        assert "32 samples trained, 0 failed, 1 recoveries" in log, log[-2000:]
