"""Phases 8-11: the training job, the resident trainer group, the new checkpoint.

    8   master   write iterations/<N>/train/job.json (TrainJob): the batch's size and
                 SHA-256; whether this iteration saves the training state
                 (train.save_interval, the run's last iteration); for a trainer
                 started anew, the newest complete saved state and the jobs since
                 it to train again (replay)
    9   all      report this node's resident trainer (group, members, iteration held)
        decide   keep the group when every member holds it at iteration N-1
                 (rl/trainer_group.py `group_to_keep`); else a new group: bind the
                 training port on the master's address and hold it
                 (TrainRendezvous); torchrun's store takes the socket over
    10  all      a new group: torchrun --rdzv-backend coordinator-static ...
                 -m trainer.resident; then the job to every local trainer process,
                 watched: exit status, wall-clock limit, and the daemon's cancel
                 event (set when a peer's lease expires), which kills the whole
                 torchrun tree at once instead of waiting for a collective timeout
    11  master   verify checkpoints/iter-<N> (written by trainer rank 0)
        decide   announce it (CheckpointAnnouncement)

With a disaggregated placement only the training nodes report, start and
feed trainers; in an asynchronous run the rollout nodes spend phase 10 rolling
out the next iteration (rl/rollouts.py `roll_out_next`).

A rerun of phase 10 (a collective step redone after a failure) moves an
existing checkpoints/iter-<N> aside first, so the trainer never has to
overwrite a published directory; the trainer that failed is gone, so the
rerun starts a new group from the saved state.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import sys
import time
from collections.abc import Mapping
from typing import Any

from coordinator import routing
from coordinator.errors import ActionError
from coordinator.machine.actions import StepContext
from coordinator.machine.netaddr import Listener
from coordinator.records.records import Arrival
from coordinator.storage import fsio
from coordinator.storage.store import read_document
from coordinator.storage.verified import file_digest
from rl import layout
from rl.config import RlSections
from rl.contracts import CheckpointAnnouncement, PolicyChoice, TrainRendezvous
from rl.loop import Loop
from rl.trainer_group import group_to_keep
from trainer.rendezvous import BACKEND as RDZV_BACKEND

log = logging.getLogger(__name__)


def write_train_job(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 8 (master): the job every trainer reads, naming exactly the batch of phase 4."""
    from trainer.job import TrainJob
    from trainer.train_state import newest_complete, state_dir

    if not ctx.is_master or not loop.trains:
        return {}
    run_dir, i = loop.run_dir, ctx.iteration
    batch = layout.batch(run_dir, i)
    batch_bytes, batch_sha256 = file_digest(batch)
    root = layout.train_state(run_dir)
    found = newest_complete(root, before=i)
    since = found[0] + 1 if found is not None else 0
    save_interval = loop.s.train.save_interval
    job = TrainJob(
        iteration=i,
        model_dir=loop.model(ctx, PolicyChoice.read(ctx).policy, where_phase=0),
        ref_model_dir=loop.initial_model() if loop.s.train.kl_coef > 0 else None,
        batch_path=batch, batch_bytes=batch_bytes, batch_sha256=batch_sha256,
        out_dir=layout.checkpoint(run_dir, i),
        state_dir=root,
        metrics_path=layout.metrics(run_dir, i, "train"),
        config=loop.s.train,
        save_state=(i + 1) % save_interval == 0 or i == loop.config.run.iterations - 1
        or not loop.s.torchrun.resident,
        resume_state=state_dir(root, found[0]) if found is not None else None,
        resume_model_dir=loop.initial_model() if found is None else None,
        replay=tuple(layout.train_job(run_dir, k) for k in range(since, i)),
        off_policy=loop.layout.off_policy,
        delta_parent=layout.checkpoint(run_dir, i - 1)
        if i > 0 and i % loop.s.checkpoint.full_every else None,
    )
    path = layout.train_job(run_dir, i)
    job.save(path, run_dir=run_dir)
    return {"job": loop.relative(path), "save_state": job.save_state,
            "resume_state": found[0] if found is not None else None}


def report_trainer(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 9 on every training node: this node's resident trainer, for the master to weigh."""
    if not loop.trains_here:
        return {}
    return {"trainer": loop.trainers.status()}


def choose_trainer_group(loop: Loop, ctx: StepContext,
                         arrivals: Mapping[int, Arrival]) -> Mapping[str, Any]:
    """Phase 9's decision: keep the resident group, or a new one on a port bound on the
    master's address and held until torchrun inherits it at phase 10, so no other
    process can take it in between."""
    if not loop.trains:
        return {}
    statuses = {rank: arrival.payload.get("trainer") for rank, arrival in arrivals.items()}
    keep = group_to_keep(statuses, loop.train_members(ctx), ctx.iteration) \
        if loop.s.torchrun.resident else None
    if keep is not None:
        return TrainRendezvous(group=keep, start=False, master_addr=ctx.address,
                               train_port=0).fields()
    loop.close_listener()
    loop.listener = Listener(ctx.address)
    group = f"{ctx.run_id[:12]}-{ctx.iteration}-{secrets.token_hex(4)}"
    log.info("iteration %d: a new trainer group %s (trainers reported: %s)", ctx.iteration,
             group, {r: (s or {}).get("group") for r, s in sorted(statuses.items())})
    return TrainRendezvous(group=group, start=True, master_addr=ctx.address,
                           train_port=loop.listener.port).fields()


def torchrun_command(s: RlSections, *, rank: int, num_nodes: int, master_addr: str,
                     master_port: int, group: str, listen_fd: int | None = None) -> list[str]:
    """torchrun with this project's rendezvous (trainer/rendezvous.py): node rank 0's
    store serves on the socket the daemon has held since it announced the port."""
    t = s.torchrun
    conf = f"rank={rank}" + (f",listen_fd={listen_fd}" if listen_fd is not None else "")
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(num_nodes), "--nproc-per-node", str(t.nproc_per_node),
        "--rdzv-backend", RDZV_BACKEND, "--rdzv-endpoint", f"{master_addr}:{master_port}",
        "--rdzv-id", group, "--rdzv-conf", conf,
        "--max-restarts", "0", *t.extra_args,
        "-m", "trainer.resident",
    ]


def train(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 10 (collective): the job to this node's trainer, started first if the master
    chose a new group (the master's store on the held port).  On a rollout node of
    an asynchronous run: the next iteration's rollout instead; on a split node
    (some GPUs train, others roll out) both at once (rl/ahead.py)."""
    if not loop.trains:
        return {}
    ahead = loop.layout.rolls_out_next(rolls_out=loop.rolls_out, iteration=ctx.iteration,
                                       iterations=loop.config.run.iterations)
    if not loop.trains_here:
        if ahead:
            from rl.rollouts import roll_out_next

            return {"next_rollout": dict(roll_out_next(loop, ctx))}
        return {}
    if ahead:  # a split node: its rollout GPUs roll out the next iteration meanwhile
        from rl.ahead import train_alongside

        return train_alongside(loop, ctx, lambda: _train_here(loop, ctx))
    return _train_here(loop, ctx)


def _train_here(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """This node's part of the collective step: its trainer ranks train the job."""
    rendezvous = TrainRendezvous.read(ctx)
    trainers = loop.trainers
    started = time.monotonic()
    if rendezvous.start:
        _start_group(loop, ctx, rendezvous)
    elif trainers.group != rendezvous.group:  # phase 9 asked it for a sign of life
        raise ActionError(
            f"the master kept trainer group {rendezvous.group}, but rank {loop.rank}'s trainer "
            f"is gone ({trainers.lost or 'not running'}): the step is redone with a new group")
    if ctx.is_master:
        _set_aside_earlier_attempt(loop, ctx.iteration)
    done = trainers.submit(ctx, layout.train_job(loop.run_dir, ctx.iteration), ctx.iteration)
    if not loop.s.torchrun.resident:
        trainers.stop("torchrun.resident is false: one group per iteration")
    loss = _train_metrics(loop, ctx.iteration).get("loss") if ctx.is_master else None
    if not (isinstance(loss, float) and math.isfinite(loss)):
        loss = None  # the arrival record carries a finite number or nothing
    return {"seconds": time.monotonic() - started, "loss": loss,
            "trainer": "started" if rendezvous.start else "kept", **done}


def _start_group(loop: Loop, ctx: StepContext, rendezvous: TrainRendezvous) -> None:
    listen_fd = None
    if ctx.is_master:
        if loop.listener is None:
            raise ActionError("the master holds no training port: phase 9 must announce one")
        listen_fd = loop.listener.fileno()
    # A group that went on without some ranks trains on its members only.
    members = loop.train_members(ctx)
    command = torchrun_command(
        loop.s, rank=members.index(loop.rank), num_nodes=len(members),
        master_addr=rendezvous.master_addr, master_port=rendezvous.train_port,
        group=rendezvous.group, listen_fd=listen_fd)
    try:
        loop.trainers.start(ctx, group=rendezvous.group, members=members, command=command,
                            pass_fds=() if listen_fd is None else (listen_fd,))
    finally:
        loop.close_listener()  # torchrun's store holds its own copy


def _set_aside_earlier_attempt(loop: Loop, iteration: int) -> None:
    out = layout.checkpoint(loop.run_dir, iteration)
    if routing.routed(out) is not None:
        # A bucket has no rename (one copy per object): the attempt's checkpoint goes
        # now, as phase 13 would remove it set aside.
        if fsio.remove_tree(out):
            log.warning("training of iteration %d is rerun: removed %s", iteration,
                        routing.display(out))
        return
    if out.exists():
        aside = out.with_name(f".superseded-{out.name}-{secrets.token_hex(4)}")
        log.warning("training of iteration %d is rerun: moving %s aside to %s", iteration, out,
                    aside)
        fsio.rename(out, aside)


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
    """Phase 11 (master): the new checkpoint's manifest reads and names exactly its files.
    Their contents are checked by every node as it copies them at phase 12 (each byte
    crosses the shared filesystem once per node, trainer/local_copy.py
    copy_to_local_cache); a file altered on the share fails phase 12 naming it."""
    from trainer.checkpoint import CheckpointError, verify_checkpoint

    if not ctx.is_master or not loop.trains:
        return {}
    try:
        manifest = verify_checkpoint(layout.checkpoint(loop.run_dir, ctx.iteration),
                                     contents=False)
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
