"""Phases 8-11: the training job, torchrun across nodes, the new checkpoint.

    8   master   write iterations/<N>/train/job.json (TrainJob), with the batch's
                 size and SHA-256
    9   all      nothing to do: arriving says this rank is ready to train
        decide   bind the training port on the master's address and hold it
                 (TrainRendezvous); torchrun's store takes the socket over
    10  all      torchrun --rdzv-backend coordinator-static ... -m trainer.train,
                 watched: exit status, wall-clock limit, and the daemon's cancel
                 event (set when a peer's lease expires), which kills the whole
                 torchrun tree at once instead of waiting for a collective timeout
    11  master   verify checkpoints/iter-<N> (written by trainer rank 0)
        decide   announce it (CheckpointAnnouncement)

A rerun of phase 10 (a collective step redone after a failure) moves an
existing checkpoints/iter-<N> aside first, so the trainer never has to
overwrite a published directory.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coordinator import fsio
from coordinator.actions import StepContext
from coordinator.beneath import RUN_DIR_ENV
from coordinator.errors import ActionError
from coordinator.netaddr import Listener
from coordinator.records import Arrival
from coordinator.store import read_document
from coordinator.verified import file_digest
from rl import layout
from rl.config import RlSections
from rl.contracts import CheckpointAnnouncement, PolicyChoice, TrainRendezvous
from rl.loop import Loop
from rollout.engines.process import ManagedProcess, describe_exit
from trainer.lifeline import LAUNCHER_PID_ENV
from trainer.rendezvous import BACKEND as RDZV_BACKEND

log = logging.getLogger(__name__)


def write_train_job(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 8 (master): the job every trainer reads, naming exactly the batch of phase 4."""
    from trainer.config import TrainJob

    if not ctx.is_master or not loop.trains:
        return {}
    run_dir = loop.run_dir
    batch = layout.batch(run_dir, ctx.iteration)
    batch_bytes, batch_sha256 = file_digest(batch)
    job = TrainJob(
        iteration=ctx.iteration,
        model_dir=loop.model(ctx, PolicyChoice.read(ctx).policy, where_phase=0),
        ref_model_dir=loop.initial_model() if loop.s.train.kl_coef > 0 else None,
        batch_path=batch, batch_bytes=batch_bytes, batch_sha256=batch_sha256,
        out_dir=layout.checkpoint(run_dir, ctx.iteration),
        optim_dir=layout.optim_dir(run_dir),
        metrics_path=layout.metrics(run_dir, ctx.iteration, "train"),
        config=loop.s.train,
    )
    path = layout.train_job(run_dir, ctx.iteration)
    job.save(path, run_dir=run_dir)
    return {"job": loop.relative(path)}


def ready_to_train(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 9 on every rank: no work; arriving says this rank is ready."""
    return {}


def open_rendezvous(loop: Loop, ctx: StepContext,
                    arrivals: Mapping[int, Arrival]) -> Mapping[str, Any]:
    """Phase 9's decision: a port bound on the master's address, held until torchrun
    inherits it at phase 10, so no other process can take it in between."""
    if not loop.trains:
        return {}
    loop.close_listener()
    loop.listener = Listener(ctx.address)
    return TrainRendezvous(master_addr=ctx.address, train_port=loop.listener.port).fields()


def torchrun_command(s: RlSections, *, rank: int, num_nodes: int, master_addr: str,
                     master_port: int, job: Path, run_id: str, iteration: int,
                     listen_fd: int | None = None) -> list[str]:
    """torchrun with this project's rendezvous (trainer/rendezvous.py): node rank 0's
    store serves on the socket the daemon has held since it announced the port."""
    t = s.torchrun
    conf = f"rank={rank}" + (f",listen_fd={listen_fd}" if listen_fd is not None else "")
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(num_nodes), "--nproc-per-node", str(t.nproc_per_node),
        "--rdzv-backend", RDZV_BACKEND, "--rdzv-endpoint", f"{master_addr}:{master_port}",
        "--rdzv-id", f"{run_id}-{iteration}", "--rdzv-conf", conf,
        "--max-restarts", "0", *t.extra_args,
        "-m", "trainer.train", "--job", str(job),
    ]


def train(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 10 (collective): torchrun on every node; the master's store on the held port."""
    if not loop.trains:
        return {}
    rendezvous = TrainRendezvous.read(ctx)
    listen_fd = None
    if ctx.is_master:
        if loop.listener is None:
            raise ActionError("the master holds no training port: phase 9 must announce one")
        listen_fd = loop.listener.fileno()
        _set_aside_earlier_attempt(loop, ctx.iteration)
    # A group that went on without some ranks trains on its members only.
    members = ctx.active_ranks
    command = torchrun_command(
        loop.s, rank=members.index(loop.rank), num_nodes=len(members),
        master_addr=rendezvous.master_addr,
        master_port=rendezvous.train_port, job=layout.train_job(loop.run_dir, ctx.iteration),
        run_id=ctx.run_id, iteration=ctx.iteration, listen_fd=listen_fd)
    started = time.monotonic()
    try:
        _run_torchrun(loop, ctx, command, listen_fd)
    finally:
        loop.close_listener()  # torchrun's store held its own copy while it ran
    loss = _train_metrics(loop, ctx.iteration).get("loss") if ctx.is_master else None
    return {"seconds": time.monotonic() - started, "loss": loss}


def _set_aside_earlier_attempt(loop: Loop, iteration: int) -> None:
    out = layout.checkpoint(loop.run_dir, iteration)
    if out.exists():
        aside = out.with_name(f".superseded-{out.name}-{secrets.token_hex(4)}")
        log.warning("training of iteration %d is rerun: moving %s aside to %s", iteration, out,
                    aside)
        fsio.rename(out, aside)


def _run_torchrun(loop: Loop, ctx: StepContext, command: list[str],
                  listen_fd: int | None) -> None:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")  # one CPU thread per trainer process
    env[LAUNCHER_PID_ENV] = str(os.getpid())  # lets a trainer see that torchrun died early
    env[RUN_DIR_ENV] = str(loop.run_dir)  # the trainer confines itself to it
    env[fsio.READ_RETRY_ENV] = str(fsio.read_retry(None))  # coordination.read_retry_s
    log_path = layout.child_log(loop.run_dir, loop.rank, f"train-iter-{ctx.iteration:06d}")
    wall_limit = loop.s.torchrun.wall_limit_s
    started = time.monotonic()
    proc = ManagedProcess(command, log_path=log_path, env=env,
                          pass_fds=() if listen_fd is None else (listen_fd,))
    ctx.add_child(proc.pid, "torchrun")
    try:
        while proc.returncode is None:
            if ctx.runtime.cancel.is_set():
                proc.stop(grace_s=2.0)
                ctx.check_cancel()
            if time.monotonic() - started > wall_limit:
                proc.stop(grace_s=5.0)
                raise ActionError(
                    f"training on rank {loop.rank} passed torchrun.wall_limit_s="
                    f"{wall_limit:g}; log tail:\n{proc.log_tail(20)}")
            time.sleep(0.1)
    finally:
        if proc.returncode is None:
            proc.stop(grace_s=2.0)
        ctx.remove_child(proc.pid)
    if proc.returncode != 0:
        raise ActionError(
            f"torchrun on rank {loop.rank} {describe_exit(proc.returncode)} "
            f"(log {log_path}); last lines:\n{proc.log_tail(20)}")


def _train_metrics(loop: Loop, iteration: int) -> dict[str, Any]:
    path = layout.metrics(loop.run_dir, iteration, "train")
    try:
        metrics = read_document(path, lambda raw, _where: json.loads(raw))
    except (OSError, ValueError) as exc:
        raise ActionError(f"the trainer wrote no readable metrics: {exc}") from exc
    if not isinstance(metrics, dict):
        raise ActionError(f"the trainer wrote no metrics at {path}")
    return metrics


def verify_new_checkpoint(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 11 (master): every file of the new checkpoint matches its manifest."""
    from trainer.checkpoint import CheckpointError, verify_checkpoint

    if not ctx.is_master or not loop.trains:
        return {}
    try:
        manifest = verify_checkpoint(layout.checkpoint(loop.run_dir, ctx.iteration))
    except CheckpointError as exc:
        raise ActionError(f"the new checkpoint is not publishable: {exc}") from exc
    return {"files": len(manifest.files)}


def announce_checkpoint(loop: Loop, ctx: StepContext,
                        arrivals: Mapping[int, Arrival]) -> Mapping[str, Any]:
    """Phase 11's decision: the checkpoint every node serves at phase 12."""
    if not loop.trains:
        return {}
    path = layout.checkpoint(loop.run_dir, ctx.iteration)
    return CheckpointAnnouncement(checkpoint=loop.relative(path)).fields()
