"""`run --master --new-run` moves the old run aside whole (coordinator/machine/runplan.py):
the coordinator's records and the action kind's own top-level outputs (rl: the training
state and the TensorBoard events), so that nothing of it is read as the new run's."""

from __future__ import annotations

import time
from pathlib import Path

from coordinator.machine.actions import resolve_config
from coordinator.machine.runplan import RunRequest, make_plan
from coordinator.records import layout as records
from coordinator.records.records import Journal, Manifest
from coordinator.storage.store import FsStore, publish_record
from rl import layout

OLD = "0123456789ab"


def test_new_run_archives_the_recoveries_training_state_and_tensorboard_with_the_run(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    resolved = resolve_config({"run": {"iterations": 8}})
    store = FsStore(run)
    publish_record(store, records.MANIFEST, Manifest(
        run_id=OLD, generation=0, num_nodes=1, weights=(1.0,), config=resolved.experiment(),
        config_hash=resolved.hash(), created=time.time()))
    publish_record(store, records.journal(0), Journal(
        run_id=OLD, rank=0, completed_iteration=7, iteration=8, done=()))
    old_files = [records.RECOVERIES, "train_state/iter-000007/shard-0.json",
                 "tensorboard/events.out.tfevents.1.host", "iterations/000007/metrics/train.json",
                 "checkpoints/iter-000007/manifest.json"]
    for name in old_files:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("{}")
    (run / "model-init").mkdir()  # the demo's built model is the input, not the run's output

    plan = make_plan(RunRequest(run_dir=run, rank=0, num_nodes=1, weights=None,
                                config_file=None, overrides={"run": {"iterations": 8}},
                                new_run=True))

    assert plan.manifest.run_id != OLD
    archive = run / "archive" / OLD
    for name in [*old_files, "run.json", "ranks/0/journal.json"]:
        assert (archive / name).is_file(), name
        assert not (run / name).exists() or name == "run.json", name
    # A trainer of the new run finds no saved state of the old one to resume from.
    assert not layout.train_state(run).exists() and not layout.tensorboard_dir(run).exists()
    assert (run / "model-init").is_dir()
