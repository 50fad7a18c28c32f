"""Phases 8-12: the training job, torchrun across nodes, the new checkpoint.

    8  master  write iterations/<N>/train/job.json (TrainJob)
    9  all     ready; the release carries the master's address and a free port
    10 all     torchrun --nnodes N --node-rank r ... -m trainer.train --job job.json,
               watched: exit status, wall-clock limit, and the daemon's cancel
               event (set when a peer's lease expires), which kills the whole
               torchrun tree at once instead of waiting for a collective timeout
    11 master  verify checkpoints/iter-<N> (written by trainer rank 0) and announce it
    12 all     copy it to the node-local cache, verify every hash, restart the engine

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
from pathlib import Path
from typing import Any

from coordinator import fsio, layout
from coordinator.actions import StepContext
from coordinator.beneath import RUN_DIR_ENV, relative_inside
from coordinator.errors import ActionError
from coordinator.phases import Phase
from coordinator.store import read_document
from coordinator.verified import file_digest
from rl.config import RlSections
from rl.engines import EngineHost
from rollout.process import ManagedProcess, describe_exit
from trainer.lifeline import LAUNCHER_PID_ENV
from trainer.rendezvous import BACKEND as RDZV_BACKEND

log = logging.getLogger(__name__)
INITIAL_MODEL = "model-init"
OPTIM_DIR = "optim"
# What a release names instead of a path for the run's initial model: that
# model may live outside the run directory (model.path), and a release never
# carries an absolute path (PROTOCOL.md, threat model).
INITIAL_POLICY = "initial"


class TrainingSteps:
    def __init__(self, s: RlSections, *, rank: int, num_nodes: int, run_dir: Path,
                 engines: EngineHost) -> None:
        self.s = s
        self.rank = rank
        self.num_nodes = num_nodes
        self.run_dir = run_dir
        self.engines = engines

    # -- where things are --------------------------------------------------------
    def initial_model(self) -> Path:
        return Path(self.s.model.path) if self.s.model.path else self.run_dir / INITIAL_MODEL

    def checkpoint_dir(self, iteration: int) -> Path:
        return self.run_dir / layout.checkpoint(iteration)

    def job_path(self, iteration: int) -> Path:
        return self.run_dir / layout.iteration_dir(iteration) / "train" / "job.json"

    def _rel(self, path: Path) -> str:
        return path.relative_to(self.run_dir).as_posix()

    def model_in_release(self, ctx: StepContext, phase: Phase, key: str) -> Path:
        """The model a release names: the initial model, or a directory checked to lie
        inside the run directory (no '..', not absolute; symlinks refused when opened)."""
        where = self.run_dir / layout.release(ctx.iteration, int(phase))
        value = ctx.release(phase).get(key)
        if value is None:
            raise ActionError(f"the phase-{int(phase)} release names no {key} ({where})")
        if value == INITIAL_POLICY:
            return self.initial_model()
        return self.run_dir / relative_inside(value, what=f"payload {key}", where=where)

    def ensure_initial_model(self, ctx: StepContext) -> None:
        """Master, phase 0: build the demo model once if no --model was given."""
        if self.s.model.path:
            if not Path(self.s.model.path, "config.json").exists():
                raise ActionError(f"model.path {self.s.model.path} has no config.json: give a "
                                  "local Hugging Face model directory")
            return
        target = self.initial_model()
        if (target / "manifest.json").exists():
            return
        log.info("building the tiny demo model in %s (warm start: %d steps)", target,
                 self.s.model.warmstart_steps)
        from trainer.warmstart import build_initial_model  # torch: only when needed

        report = build_initial_model(target, seed=self.s.model.init_seed,
                                     warmstart_steps=self.s.model.warmstart_steps)
        log.info("tiny model ready: %s", report)

    def policy_for(self, iteration: int) -> str:
        """The model iteration N samples from: the newest checkpoint before N."""
        from trainer.checkpoint import CheckpointError, read_manifest

        for k in range(iteration - 1, -1, -1):
            try:
                read_manifest(self.checkpoint_dir(k))
            except (CheckpointError, OSError):
                continue
            return self._rel(self.checkpoint_dir(k))
        return INITIAL_POLICY

    # -- the phases ------------------------------------------------------------------
    def run(self, phase: Phase, ctx: StepContext, *, trains: bool) -> dict[str, Any]:
        if not trains:
            return {}
        if phase is Phase.PREPARE_TRAINING:
            return self._prepare(ctx) if ctx.is_master else {}
        if phase is Phase.TRAIN:
            return self._train(ctx)
        if phase is Phase.PUBLISH_CHECKPOINT:
            return self._verify(ctx) if ctx.is_master else {}
        if phase is Phase.RESTART_ENGINE:
            announced = ctx.release(Phase.PUBLISH_CHECKPOINT).get("checkpoint")
            model = self.model_in_release(ctx, Phase.PUBLISH_CHECKPOINT, "checkpoint") \
                if announced else self.model_in_release(ctx, Phase.SYNC, "policy")
            self.engines.ensure(ctx, model)
            return {"serving": str(announced or ctx.release(Phase.SYNC).get("policy"))}
        return {}

    def announce(self, ctx: StepContext, *, trains: bool) -> dict[str, Any]:
        if not trains:
            return {}
        return {"checkpoint": self._rel(self.checkpoint_dir(ctx.iteration))}

    def _prepare(self, ctx: StepContext) -> dict[str, Any]:
        from trainer.config import TrainJob

        batch = self.run_dir / layout.iteration_dir(ctx.iteration) / "batch.pt"
        # The trainer loads exactly the batch phase 4 published, or nothing.
        batch_bytes, batch_sha256 = file_digest(batch)
        job = TrainJob(
            iteration=ctx.iteration,
            model_dir=self.model_in_release(ctx, Phase.SYNC, "policy"),
            ref_model_dir=self.initial_model() if self.s.train.kl_coef > 0 else None,
            batch_path=batch,
            batch_bytes=batch_bytes,
            batch_sha256=batch_sha256,
            out_dir=self.checkpoint_dir(ctx.iteration),
            optim_dir=self.run_dir / OPTIM_DIR,
            metrics_path=self.run_dir / layout.iteration_dir(ctx.iteration) / "metrics"
            / "train.json",
            config=self.s.train,
        )
        job.save(self.job_path(ctx.iteration), run_dir=self.run_dir)
        return {"job": self._rel(self.job_path(ctx.iteration))}

    def command(self, *, master_addr: str, master_port: int, job: Path, run_id: str,
                iteration: int, listen_fd: int | None = None) -> list[str]:
        """torchrun with this project's rendezvous (trainer/rendezvous.py): node rank 0's
        store serves on the socket the daemon has held since it announced the port."""
        t = self.s.torchrun
        conf = f"rank={self.rank}" + (f",listen_fd={listen_fd}" if listen_fd is not None else "")
        return [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(self.num_nodes), "--nproc-per-node", str(t.nproc_per_node),
            "--rdzv-backend", RDZV_BACKEND, "--rdzv-endpoint", f"{master_addr}:{master_port}",
            "--rdzv-id", f"{run_id}-{iteration}", "--rdzv-conf", conf,
            "--max-restarts", "0", *t.extra_args,
            "-m", "trainer.train", "--job", str(job),
        ]

    def _train(self, ctx: StepContext) -> dict[str, Any]:
        ready = ctx.release(Phase.READY_TO_TRAIN)
        addr, port = ready.get("master_addr"), ready.get("train_port")
        if not isinstance(addr, str) or not isinstance(port, int):
            raise ActionError(f"the phase-9 release carries no master address/port: {ready}")
        out = self.checkpoint_dir(ctx.iteration)
        if ctx.is_master and out.exists():
            aside = out.with_name(f".superseded-{out.name}-{secrets.token_hex(4)}")
            log.warning("training of iteration %d is rerun: moving %s aside to %s",
                        ctx.iteration, out, aside)
            fsio.rename(out, aside)
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("OMP_NUM_THREADS", "1")  # one CPU thread per trainer process
        env[LAUNCHER_PID_ENV] = str(os.getpid())  # lets a trainer see that torchrun died early
        env[RUN_DIR_ENV] = str(self.run_dir)  # the trainer confines itself to it
        log_path = self.run_dir / layout.logs(self.rank) / f"train-iter-{ctx.iteration:06d}.log"
        listener = ctx.listener if ctx.is_master else None
        if ctx.is_master and listener is None:
            raise ActionError("the master holds no training port: phase 9 must announce one")
        listen_fd = listener.fileno() if listener is not None else None
        command = self.command(master_addr=addr, master_port=port,
                               job=self.job_path(ctx.iteration), run_id=ctx.run_id,
                               iteration=ctx.iteration, listen_fd=listen_fd)
        started = time.monotonic()
        proc = ManagedProcess(command, log_path=log_path, env=env,
                              pass_fds=() if listen_fd is None else (listen_fd,))
        ctx.add_child(proc.pid, "torchrun")
        try:
            while proc.returncode is None:
                if ctx.runtime.cancel.is_set():
                    proc.stop(grace_s=2.0)
                    ctx.check_cancel()
                if time.monotonic() - started > self.s.torchrun.wall_limit_s:
                    proc.stop(grace_s=5.0)
                    raise ActionError(
                        f"training on rank {self.rank} passed torchrun.wall_limit_s="
                        f"{self.s.torchrun.wall_limit_s:g}; log tail:\n{proc.log_tail(20)}")
                time.sleep(0.1)
        finally:
            if proc.returncode is None:
                proc.stop(grace_s=2.0)
            ctx.remove_child(proc.pid)
        if proc.returncode != 0:
            raise ActionError(
                f"torchrun on rank {self.rank} {describe_exit(proc.returncode)} "
                f"(log {log_path}); last lines:\n{proc.log_tail(20)}")
        metrics = {}
        if ctx.is_master:
            path = self.run_dir / layout.iteration_dir(ctx.iteration) / "metrics" / "train.json"
            try:
                metrics = read_document(path, lambda raw, _where: json.loads(raw))
            except (OSError, ValueError) as exc:
                raise ActionError(f"the trainer wrote no readable metrics: {exc}") from exc
            if metrics is None:
                raise ActionError(f"the trainer wrote no metrics at {path}")
        return {"seconds": time.monotonic() - started,
                "loss": metrics.get("loss") if isinstance(metrics, dict) else None}

    def _verify(self, ctx: StepContext) -> dict[str, Any]:
        from trainer.checkpoint import CheckpointError, verify_checkpoint

        try:
            manifest = verify_checkpoint(self.checkpoint_dir(ctx.iteration))
        except CheckpointError as exc:
            raise ActionError(f"the new checkpoint is not publishable: {exc}") from exc
        return {"files": len(manifest.files)}

    def prune_checkpoints(self, iteration: int) -> None:
        """Keep the newest `checkpoint.keep` checkpoints up to `iteration`."""
        keep = self.s.checkpoint.keep
        root = self.run_dir / layout.CHECKPOINTS
        for k in range(iteration - keep, -1, -1):
            path = self.checkpoint_dir(k)
            if not fsio.remove_tree(path):
                break  # older ones were pruned before
            log.info("pruned %s (checkpoint.keep=%d)", path, keep)
        if root.is_dir():
            for child in root.iterdir():
                if child.name.startswith(".superseded-"):
                    fsio.remove_tree(child)
