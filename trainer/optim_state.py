"""Carry AdamW's moments and step count from one training iteration to the next.

`trainer.checkpoint` stores and validates the per-rank files; this module is
the glue between those records and a live optimizer: whether a saved state
fits this rank's parameters, the collective decision to restore it (every
rank or none), and the DTensor re-wrapping FSDP2 needs after loading.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch import Tensor

from trainer.checkpoint import OptimizerState, load_optimizer_state, save_optimizer_state
from trainer.config import Strategy, TrainJob
from trainer.distributed import DistContext, all_reduce

log = logging.getLogger("trainer")


def _local(value: Any) -> Any:
    return value.to_local() if hasattr(value, "to_local") else value


def _fits(saved: OptimizerState, params: list[Any], groups: int, ctx: DistContext) -> bool:
    """Whether a saved state can be loaded into this optimizer on this rank."""
    if saved.strategy != ctx.strategy.value:
        return False
    if ctx.strategy == Strategy.FSDP2 and saved.world_size != ctx.world_size:
        return False  # shards only fit the split they were cut for
    state = saved.optimizer["state"]
    if len(saved.optimizer["param_groups"]) != groups or len(state) > len(params):
        return False
    return all(
        isinstance(i, int)
        and 0 <= i < len(params)
        and isinstance(entry.get("exp_avg"), Tensor)
        and entry["exp_avg"].shape == _local(params[i]).shape
        for i, entry in state.items()
    )


def restore_optimizer(optimizer: Any, job: TrainJob, ctx: DistContext) -> int:
    """Load this rank's saved optimizer state if every rank has a matching one.

    The decision is collective: replicas (DDP) or shards (FSDP2) whose Adam
    states came from different iterations would silently drift apart.
    Returns the optimizer step count the iteration starts from.
    """
    saved = load_optimizer_state(job.optim_dir, rank=ctx.rank, before_iteration=job.iteration)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    usable = saved is not None and _fits(saved, params, len(optimizer.param_groups), ctx)
    key = [saved.iteration, saved.step] if saved is not None and usable else [-1, -1]
    low = all_reduce(key, ctx, dist.ReduceOp.MIN if ctx.is_distributed else None)
    high = all_reduce(key, ctx, dist.ReduceOp.MAX if ctx.is_distributed else None)
    if low[0] < 0 or low != high:
        if high[0] >= 0:
            log.warning(
                "optimizer state in %s is missing, unfit or from different iterations on some "
                "rank: every rank starts with fresh Adam moments",
                job.optim_dir,
            )
        return 0
    assert saved is not None
    optimizer.load_state_dict(saved.optimizer)
    for group in optimizer.param_groups:  # this iteration's config wins over the saved one
        group.update(
            lr=job.config.lr,
            betas=job.config.betas,
            eps=job.config.adam_eps,
            weight_decay=job.config.weight_decay,
        )
    if ctx.strategy == Strategy.FSDP2:
        from torch.distributed.tensor import DTensor

        for p in params:
            for k, v in optimizer.state.get(p, {}).items():
                if k != "step" and isinstance(p, DTensor) and not isinstance(v, DTensor):
                    optimizer.state[p][k] = DTensor.from_local(
                        v.to(p.device), p.device_mesh, p.placements
                    )
    log.info("restored optimizer state of iteration %d (step %d)", saved.iteration, saved.step)
    return saved.step


def save_optimizer(optimizer: Any, job: TrainJob, ctx: DistContext, step: int) -> None:
    """Save this rank's optimizer state (its shard under FSDP2) as plain local tensors."""
    sd = optimizer.state_dict()
    sd["state"] = {i: {k: _local(v) for k, v in s.items()} for i, s in sd["state"].items()}
    save_optimizer_state(
        OptimizerState(
            iteration=job.iteration,
            rank=ctx.rank,
            world_size=ctx.world_size,
            strategy=ctx.strategy.value,
            step=step,
            optimizer=sd,
        ),
        job.optim_dir,
    )
