"""Paths the trainer takes from the shared run directory, which others may write.  A
train job: what it makes the trainer write stays inside the run directory, and what it
makes the trainer read (a model whose non-weight files are carried into the published
checkpoint) is inside it or the node's own initial model (trainer/job.py,
trainer/worker.py).  A sharded model's index: it names only shards beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.channel import MODEL_DIR_ENV
from trainer.config import ConfigError
from trainer.job import TrainJob
from trainer.worker import read_job


def job_file(run: Path, **paths: Path | None) -> Path:
    fields: dict = dict(iteration=3, model_dir=run / "checkpoints/iter-000002",
                        ref_model_dir=None, batch_path=run / "iterations/000003/batch.pt",
                        out_dir=run / "checkpoints/iter-000003", state_dir=run / "train_state",
                        metrics_path=run / "iterations/000003/metrics/train.json")
    fields.update(paths)
    path = run / "iterations/000003/train/job.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TrainJob(**fields).to_json(run))
    return path


def test_a_job_reads_only_the_run_directory_and_the_nodes_initial_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run, model, private = tmp_path / "run", tmp_path / "model", tmp_path / "home" / ".ssh"
    run.mkdir()
    monkeypatch.setenv(MODEL_DIR_ENV, str(model))
    # What the master writes: the last checkpoint, or the initial model to resume from.
    assert read_job(job_file(run), run).model_dir == run / "checkpoints/iter-000002"
    assert read_job(job_file(run, resume_model_dir=model), run).start_model_dir == model
    # A forged job: another directory as the model its files would be carried from.
    for name in ("model_dir", "ref_model_dir", "resume_model_dir"):
        with pytest.raises(ConfigError, match=rf"train job field {name}='{private}' is neither "
                           rf"inside the run directory {run} nor this node's model.path "
                           rf"{model}: the job file is forged"):
            read_job(job_file(run, **{name: private}), run)
    # A trainer started by hand (no daemon set the variable) reads what its job names.
    monkeypatch.delenv(MODEL_DIR_ENV)
    assert read_job(job_file(run, model_dir=private), run).model_dir == private


@pytest.mark.parametrize("name", ["../../../../etc/hostname", "/etc/hostname", "sub/x.safetensors",
                                  ".model.safetensors.tmp", "model.bin", 7])
def test_a_sharded_index_naming_anything_but_a_shard_beside_it_is_refused(
        tmp_path: Path, name: object) -> None:
    """model.safetensors.index.json may come from the share: its weight_map opens no
    other file (a FIFO named there blocked the read for ever)."""
    import json

    import torch

    from rollout.hf.weights import WeightsError, load_safetensors
    from trainer.errors import TrainError
    from trainer.sharded_load import weight_files

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": name}}))
    with pytest.raises(TrainError, match=r"model\.safetensors\.index\.json: weight_map names "):
        weight_files(tmp_path)
    with pytest.raises(WeightsError, match=r"weight_map names .*not a \.safetensors file"):
        load_safetensors(tmp_path, torch=torch)
