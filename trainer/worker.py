"""What every trainer process does around its work, one job or many.

`prepare_process` once before anything (die with torchrun, stay offline),
`setup_logging` per job (the iteration is in every line), `read_job` (the
job file read confined to the run directory, its writes checked to stay in
it), `start_distributed` (deterministic kernels, the process group) and
`exit_code` (what a failure makes the process return: 2 for a bad job,
batch or checkpoint, 1 for anything else).  trainer/train.py (one job per
process) and trainer/resident.py (a job per iteration, for a whole session)
both run through these.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Final

import torch
import torch.distributed

from coordinator.storage import beneath, fsio
from coordinator.storage.beneath import RUN_DIR_ENV
from rollout.errors import CheckpointError
from trainer.channel import MODEL_DIR_ENV
from trainer.config import TrainerError
from trainer.distributed import DistContext, init_distributed
from trainer.job import TrainJob
from trainer.lifeline import die_with_parent

log = logging.getLogger("trainer")


def setup_logging(rank: int, world: int, iteration: int | str) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [trainer it={iteration} rank={rank}/{world}] %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    for noisy in ("transformers", "torch", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def prepare_process() -> Path | None:
    """Process-wide setup once per rank before any work: die with torchrun, stay
    offline, and, when a daemon started us, confine every path inside the run
    directory (opened without following symlinks).  Returns that run directory."""
    die_with_parent()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    fsio.read_retry_from_env()  # the daemon's coordination.read_retry_s
    if os.environ.get("COORDINATOR_BUCKET_URL"):  # a bucket run directory: the daemon's mount
        from coordinator.storage import objstore

        objstore.attach_from_env()
    import transformers.utils.logging as hf_logging

    hf_logging.disable_progress_bar()  # tqdm bars would flood the per-rank logs
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return None
    beneath.confine(Path(run_dir))
    return Path(run_dir)


def read_job(path: Path, run_dir: Path | None) -> TrainJob:
    """The job, its relative paths resolved in `run_dir`; a job from a daemon may write
    nowhere outside the run directory."""
    job = TrainJob.load(path, run_dir=run_dir)
    if run_dir is not None:
        job.check_writes_inside(run_dir)
        model = os.environ.get(MODEL_DIR_ENV)  # set by the daemon that starts the trainer
        if model:
            job.check_reads_from(run_dir, Path(model))
    return job


def start_distributed(job: TrainJob) -> DistContext:
    """Deterministic kernels (process-wide, so here and not in tests' in-process runs;
    warn_only: a few CUDA kernels have no deterministic version), then the group."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    return init_distributed(job.config)


# What a collective raises on a rank whose peer went away mid-step (gloo's TCP
# transport, NCCL's watchdog): the cause is on another node.
_PEER_GONE: Final = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                     "NCCL communicator was aborted", "remote process exited")


def lost_peer(exc: BaseException) -> bool:
    """Whether `exc` says a peer of the group went away rather than what failed here."""
    return isinstance(exc, torch.distributed.DistNetworkError) or any(
        sign in str(exc) for sign in _PEER_GONE)


def exit_code(exc: BaseException) -> int:
    """2 for a bad job, batch or checkpoint (a rerun will not help), else 1; logged."""
    if isinstance(exc, (TrainerError, CheckpointError)):
        log.error("failed: %s", exc)
        print(f"trainer: error: {exc}", file=sys.stderr, flush=True)
        return 2
    log.error("failed with an unexpected error", exc_info=exc)
    print(f"trainer: unexpected error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    return 1
