"""The iteration's batch as training reads it.

`load_batch` loads the file only if it is still exactly what the master
published (size and SHA-256 from the job) and belongs to this iteration;
`check_vocab` refuses token ids the model has no embedding for, naming the
sample, before a forward pass would fail with an index error.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollout.batch_format import TrainBatch, TrainBatchError
from rollout.train_batch import load_train_batch
from trainer.errors import TrainError
from trainer.job import TrainJob


def load_batch(job: TrainJob) -> TrainBatch:
    """The iteration's batch, exactly as the master published it and for this iteration."""
    path = job.batch_path
    try:
        batch = load_train_batch(path, size=job.batch_bytes, sha256=job.batch_sha256)
    except FileNotFoundError:
        raise TrainError(
            f"batch file {path} does not exist: the rollout phase must write it"
        ) from None
    except TrainBatchError as exc:
        raise TrainError(str(exc)) from exc
    if batch.iteration != job.iteration:
        raise TrainError(
            f"{path} holds the batch of iteration {batch.iteration}, but this is "
            f"iteration {job.iteration}: a stale batch; aggregate iteration {job.iteration} again"
        )
    if batch.num_samples == 0:
        # Publishing the unchanged model as the next policy would hide that the
        # iteration learned nothing; phase 4 refuses such a batch before this.
        raise TrainError(
            f"{path} holds no samples: nothing to train on; the iteration's rollout must "
            "yield a batch (rollout.min_batch_fraction)")
    return batch


def check_vocab(batch: TrainBatch, vocab: int, source: Path) -> None:
    """Every prompt and response token id is below `vocab`; else TrainError naming the sample."""
    for name in ("prompt", "response"):
        flat, offsets = getattr(batch, f"{name}_tokens"), getattr(batch, f"{name}_offsets")
        bad = ((flat < 0) | (flat >= vocab)).nonzero()
        if bad.numel():
            pos = int(bad[0, 0])
            sample = int(torch.searchsorted(offsets, torch.tensor(pos), right=True)) - 1
            raise TrainError(
                f"{source}: sample {sample} ({batch.task_ids[sample]}) has {name} token id "
                f"{int(flat[pos])} outside the model's vocabulary 0..{vocab - 1}: the batch "
                "was made with another tokenizer"
            )
