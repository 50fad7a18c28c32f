"""Carry AdamW's moments and step count from one training iteration to the next.

Two halves.  The file format: one file per rank, `optim_dir/rank-R.pt`, a
torch.save of a versioned dict validated on load.  When a new state is saved
the previous iteration's file is kept as `rank-R.prev.pt`: if the iteration is
then retried (its checkpoint never got published), the retry restores the
state from *before* the failed attempt instead of applying its moments twice.

The glue to a live optimizer: whether a saved state fits this rank's
parameters, the collective decision to restore it (every rank or none), and
the DTensor re-wrapping FSDP2 needs after loading.
"""

from __future__ import annotations

import io
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import Tensor

from coordinator.fsio import publish_bytes
from rollout.errors import CheckpointError
from trainer.config import Strategy, TrainJob
from trainer.distributed import DistContext, all_reduce

log = logging.getLogger("trainer")

OPTIM_SCHEMA: Final = "coordinator/optimizer-state"
OPTIM_VERSION: Final = 1


# ---------------------------------------------------------------- the file format


@dataclass(frozen=True, kw_only=True)
class OptimizerState:
    iteration: int  # the iteration whose update produced this state
    rank: int
    world_size: int
    strategy: str
    step: int  # optimizer steps taken so far, over all iterations
    optimizer: dict[str, Any]  # torch.optim.Optimizer.state_dict()


def optimizer_state_path(optim_dir: Path, rank: int, *, previous: bool = False) -> Path:
    return optim_dir / (f"rank-{rank}.prev.pt" if previous else f"rank-{rank}.pt")


def _load_optimizer_file(path: Path) -> OptimizerState:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unpickling failure means a corrupt or foreign file
        raise CheckpointError(f"{path}: unreadable optimizer state ({exc})", path=path) from exc
    if not isinstance(data, dict) or data.get("schema") != OPTIM_SCHEMA:
        raise CheckpointError(
            f"{path}: not an optimizer state (schema {OPTIM_SCHEMA!r})", path=path
        )
    if data.get("version") != OPTIM_VERSION:
        raise CheckpointError(
            f"{path}: version {data.get('version')!r} is not {OPTIM_VERSION}", path=path
        )
    for key in ("iteration", "rank", "world_size", "step"):
        value = data.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(
                f"{path}: field {key}={value!r} must be an integer >= 0", path=path
            )
    optimizer = data.get("optimizer")
    if not isinstance(optimizer, dict) or set(optimizer) != {"state", "param_groups"}:
        raise CheckpointError(f"{path}: field optimizer is not an optimizer state_dict", path=path)
    return OptimizerState(
        iteration=data["iteration"],
        rank=data["rank"],
        world_size=data["world_size"],
        strategy=str(data.get("strategy")),
        step=data["step"],
        optimizer=optimizer,
    )


def save_optimizer_state(state: OptimizerState, optim_dir: Path) -> Path:
    """Publish this rank's state atomically, keeping the previous iteration's as .prev."""
    path = optimizer_state_path(optim_dir, state.rank)
    if path.exists():
        try:
            older = _load_optimizer_file(path)
        except CheckpointError as exc:
            log.warning("replacing unreadable %s: %s", path, exc)
        else:
            if older.iteration < state.iteration:
                os.replace(path, optimizer_state_path(optim_dir, state.rank, previous=True))
    buffer = io.BytesIO()
    torch.save(
        {
            "schema": OPTIM_SCHEMA,
            "version": OPTIM_VERSION,
            "iteration": state.iteration,
            "rank": state.rank,
            "world_size": state.world_size,
            "strategy": state.strategy,
            "step": state.step,
            "optimizer": state.optimizer,
        },
        buffer,
    )
    publish_bytes(path, buffer.getvalue())
    return path


def load_optimizer_state(
    optim_dir: Path, *, rank: int, before_iteration: int
) -> OptimizerState | None:
    """This rank's newest saved state from an iteration before `before_iteration`, if any.

    Unreadable files are logged and skipped: losing Adam's moments costs a
    little progress, refusing to train would stall the run.
    """
    best: OptimizerState | None = None
    for previous in (False, True):
        path = optimizer_state_path(optim_dir, rank, previous=previous)
        if not path.exists():
            continue
        try:
            state = _load_optimizer_file(path)
        except CheckpointError as exc:
            log.warning("ignoring optimizer state: %s", exc)
            continue
        if state.rank != rank:
            log.warning("ignoring %s: it belongs to rank %d", path, state.rank)
            continue
        if state.iteration < before_iteration and (
            best is None or state.iteration > best.iteration
        ):
            best = state
    return best


# ---------------------------------------------------------------- the live optimizer


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


def _rewrap_shards(optimizer: Any, params: list[Any]) -> None:
    """Loaded FSDP2 moments are plain local tensors: make them DTensors like their params."""
    from torch.distributed.tensor import DTensor

    for p in params:
        for k, v in optimizer.state.get(p, {}).items():
            if k != "step" and isinstance(p, DTensor) and not isinstance(v, DTensor):
                optimizer.state[p][k] = DTensor.from_local(
                    v.to(p.device), p.device_mesh, p.placements
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
        _rewrap_shards(optimizer, params)
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
