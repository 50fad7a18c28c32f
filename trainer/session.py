"""A trainer's model and optimizer, kept from one iteration's job to the next.

    open_session(job, ctx)   load job.start_model_dir, build the optimizer, restore
                             job.resume_state (every rank or none)
    Session.save_state(...)  the resumable state to the run directory (train_state.py)
    Session.offload()/onload()  weights, grads and optimizer state to CPU memory and
                             back (GPU only: on a CPU nothing moves)

A resident trainer (trainer/resident.py) holds one Session for its whole
torchrun group; `python -m trainer.train` opens one per job.  What one
iteration does with it is trainer/train.py's.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rollout.errors import CheckpointError
from trainer import train_state
from trainer.checkpoint import saved_dtype
from trainer.config import Offload, ParamDType, Strategy, TrainConfig
from trainer.distributed import DistContext, all_reduce, unwrap
from trainer.job import TrainJob
from trainer.master_weights import MasterWeightsAdamW
from trainer.policy import load_policy

log = logging.getLogger("trainer")


def _local(value: Any) -> Any:
    return value.to_local() if hasattr(value, "to_local") else value


class Session:
    """The live training state: wrapped model, tokenizer, optimizer, step, iteration."""

    def __init__(self, *, ctx: DistContext, config: TrainConfig, model: Any, tokenizer: Any,
                 optimizer: Any, publish_dtype: str = "float32") -> None:
        self.ctx = ctx
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.optimizer = optimizer
        # The dtype checkpoints are published in: the start model's own (a bf16 model
        # stays bf16); the fp32 master weights live in memory and in train_state/.
        self.publish_dtype = publish_dtype
        self.step = 0  # optimizer steps taken over the run
        self.through = -1  # the last iteration whose update the weights hold
        self.saved_through = -1  # the last iteration whose state is in the run directory
        self.resumed: dict[str, Any] = {}  # how it started: for the first job's metrics
        self.offloaded = False

    # ---------------------------------------------------------------- weights

    def _named(self) -> list[tuple[str, Any]]:
        return [(n, p) for n, p in unwrap(self.model).named_parameters() if p.requires_grad]

    def _masters(self) -> list[Any]:
        """The fp32 tensors the optimizer updates, in the order of `_named`."""
        if isinstance(self.optimizer, MasterWeightsAdamW):
            return list(self.optimizer.masters)
        return [p for _, p in self._named()]

    def master_weights(self) -> dict[str, Tensor]:
        """This rank's fp32 master weights by name (its own slices under FSDP2)."""
        return {name: _local(t).detach().float().cpu()
                for (name, _), t in zip(self._named(), self._masters(), strict=True)}

    def _check_weights_fit(self, weights: dict[str, Tensor], where: Path) -> None:
        """CheckpointError unless `weights` names exactly this rank's parameters, in
        their shapes: a state saved from another model, or from one whose tied matrix
        was saved under two names (an FSDP2 trainer before the tie was kept on the
        meta build), is not resumed."""
        named = self._named()
        names = {n for n, _ in named}
        if set(weights) != names:
            missing = sorted(names - set(weights))[:3]
            extra = sorted(set(weights) - names)[:3]
            raise CheckpointError(f"{where}: its weights do not fit this model (missing "
                                  f"{missing}, unexpected {extra})", path=where)
        for name, p in named:
            if tuple(weights[name].shape) != tuple(_local(p).shape):
                raise CheckpointError(f"{where}: {name} has shape {tuple(weights[name].shape)}, "
                                      f"this rank's is {tuple(_local(p).shape)}", path=where)

    def _load_weights(self, weights: dict[str, Tensor]) -> None:
        named = self._named()
        with torch.no_grad():
            for (name, p), master in zip(named, self._masters(), strict=True):
                _local(p).copy_(weights[name])
                if master is not p:
                    _local(master).copy_(weights[name])

    # ---------------------------------------------------------------- the state

    def shards(self) -> int:
        """How many shards a saved state of this group has (train_state.py)."""
        fsdp = self.ctx.is_distributed and self.ctx.strategy == Strategy.FSDP2
        return self.ctx.world_size if fsdp else 1

    def save_state(self, root: Path, iteration: int, *, collective: bool = True) -> bool:
        """Write this rank's shard of the state (none on ranks > 0 under DDP); whether
        this rank wrote one.

        Collective by default: every rank returns once every shard is published.
        A clean stop saves without the barrier, each rank on its own.
        """
        shards = self.shards()
        wrote = self.ctx.rank < shards
        if wrote:
            sd = self.optimizer.state_dict()
            sd["state"] = {i: {k: _local(v).cpu() if isinstance(_local(v), Tensor) else v
                               for k, v in s.items()} for i, s in sd["state"].items()}
            train_state.save_shard(
                train_state.state_dir(root, iteration), iteration=iteration,
                shard=self.ctx.rank, shards=shards, world_size=self.ctx.world_size,
                strategy=self.ctx.strategy.value, step=self.step,
                weights=self.master_weights(), optimizer=sd)
        if collective and self.ctx.is_distributed:
            dist.barrier()
        self.saved_through = iteration
        if wrote:
            log.info("saved the training state of iteration %d (step %d) in %s", iteration,
                     self.step, train_state.state_dir(root, iteration))
        return wrote

    def restore(self, directory: Path) -> bool:
        """Load the saved state in `directory` on every rank, or on none (False)."""
        try:
            shard = self._read_shard(directory)
        except CheckpointError as exc:
            log.warning("cannot resume from %s: %s", directory, exc)
            shard = None
        usable = all_reduce([1.0 if shard is not None else 0.0], self.ctx,
                            dist.ReduceOp.MIN if self.ctx.is_distributed else None)[0]
        if usable < 1 or shard is None:
            return False
        self._load_weights(shard.weights)
        self.optimizer.load_state_dict(shard.optimizer)
        for group in self.optimizer.param_groups:  # this run's config wins over the saved one
            group.update(lr=self.config.lr, betas=self.config.betas, eps=self.config.adam_eps,
                         weight_decay=self.config.weight_decay)
        if self.ctx.strategy == Strategy.FSDP2 and self.ctx.is_distributed:
            self._rewrap_moments()
        self.step, self.through = shard.index.step, shard.index.iteration
        self.saved_through = shard.index.iteration
        log.info("resumed from the training state of iteration %d (step %d)", self.through,
                 self.step)
        return True

    def _read_shard(self, directory: Path) -> train_state.Shard:
        indexes = train_state.complete_state(directory)
        first = indexes[0]
        if first.shards > 1 and (first.world_size, first.strategy) != (
                self.ctx.world_size, self.ctx.strategy.value):
            raise CheckpointError(
                f"{directory}: sharded by {first.strategy} over {first.world_size} ranks; this "
                f"group has {self.ctx.world_size} ({self.ctx.strategy.value})", path=directory)
        shard = train_state.load_shard(directory, indexes[self.ctx.rank if first.shards > 1
                                                          else 0])
        self._check_weights_fit(shard.weights, directory)
        self._check_optimizer_fits(shard.optimizer, directory)
        return shard

    def _check_optimizer_fits(self, saved: dict[str, Any], where: Path) -> None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = saved["state"]
        fits = len(saved["param_groups"]) == len(self.optimizer.param_groups) and all(
            isinstance(i, int) and 0 <= i < len(params)
            and isinstance(entry, dict) and isinstance(entry.get("exp_avg"), Tensor)
            and entry["exp_avg"].shape == _local(params[i]).shape
            for i, entry in state.items())
        if not fits:
            raise CheckpointError(f"{where}: its optimizer state does not fit this model",
                                  path=where)

    def _rewrap_moments(self) -> None:
        """Loaded FSDP2 moments are plain local tensors: make them DTensors like their params."""
        from torch.distributed.tensor import DTensor

        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for k, v in self.optimizer.state.get(p, {}).items():
                    if k != "step" and isinstance(p, DTensor) and not isinstance(v, DTensor):
                        self.optimizer.state[p][k] = DTensor.from_local(
                            v.to(p.device), p.device_mesh, p.placements)

    # ---------------------------------------------------------------- offload

    @property
    def offloads(self) -> bool:
        """Whether the weights leave the accelerator between jobs (never on a CPU)."""
        return self.ctx.device.type != "cpu" and self.config.offload != Offload.OFF

    def offload(self) -> None:
        """Weights, grads and optimizer state to CPU memory; the GPU's cache emptied."""
        if not self.offloads or self.offloaded:
            return
        self.optimizer.zero_grad(set_to_none=True)
        self._move(torch.device("cpu"))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.offloaded = True

    def onload(self) -> None:
        if not self.offloaded:
            return
        self._move(self.ctx.device)
        self.offloaded = False

    def _move(self, device: torch.device) -> None:
        # FSDP2 re-registers its sharded parameters after Module._apply (its own
        # _apply); DDP keeps its gradient buckets on the GPU (fsdp2 frees more).
        unwrap(self.model).to(device)
        inner = self.optimizer.inner if isinstance(self.optimizer, MasterWeightsAdamW) \
            else self.optimizer
        if isinstance(self.optimizer, MasterWeightsAdamW):
            for master in self.optimizer.masters:
                master.data = master.data.to(device, non_blocking=True)
        for state in inner.state.values():
            for key, value in state.items():
                if isinstance(value, Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)


def open_session(job: TrainJob, ctx: DistContext) -> Session:
    """A session on `job.start_model_dir`, resumed from `job.resume_state` when given.

    A state that cannot be loaded on every rank leaves every rank on
    `job.model_dir`'s weights with fresh Adam moments (a warning says why); the
    caller then skips the replay, since that model already holds those
    iterations.
    """
    config = job.config
    bf16 = config.param_dtype == ParamDType.BFLOAT16
    model_dir = job.start_model_dir
    wrapped, tokenizer = load_policy(model_dir, ctx, trainable=True,
                                     dtype=torch.bfloat16 if bf16 else torch.float32,
                                     checkpointing=config.activation_checkpointing)
    # bf16 parameters keep fp32 copies and moments in the optimizer (master_weights.py).
    optimizer = (MasterWeightsAdamW if bf16 else torch.optim.AdamW)(
        wrapped.parameters(), lr=config.lr, betas=config.betas, eps=config.adam_eps,
        weight_decay=config.weight_decay)
    session = Session(ctx=ctx, config=config, model=wrapped, tokenizer=tokenizer,
                      optimizer=optimizer, publish_dtype=saved_dtype(model_dir))
    session.through = job.iteration - 1 - len(job.replay)
    session.resumed = {"from_state": None, "model": str(model_dir)}
    if job.resume_state is not None:
        if session.restore(job.resume_state):
            session.resumed["from_state"] = session.through
        else:
            fallback = job.model_dir
            log.warning("every rank starts from %s with fresh Adam moments", fallback)
            if model_dir != fallback:
                return open_session(dataclasses.replace(
                    job, resume_state=None, resume_model_dir=None, replay=()), ctx)
            session.through = job.iteration - 1
            session.resumed["fresh_optimizer"] = True
    return session
