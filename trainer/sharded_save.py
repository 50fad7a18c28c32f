"""Publishing an FSDP2 model's weights: gathered onto rank 0, or staged shard by shard.

Gathered (when the published model fits in rank 0's free memory, the usual case):

    every rank   each tensor of the state cast to the checkpoint's dtype on its own
                 shard, then all-gathered over the process group (the trainer's
                 network, not the shared filesystem), one tensor at a time
    rank 0       keeps each full tensor in CPU memory; the others drop theirs at once
    rank 0       publish_checkpoint(state_dict=<gathered>): the path of a single
                 process, so the checkpoint is a delta of the last one where it can be
                 (trainer/kept_delta.py) and otherwise written on the node's disk and
                 copied to the share once, hashed as it goes (trainer/publisher.py)

Staged (the model in the checkpoint's dtype would not fit in rank 0's free memory):

    every rank   get_model_state_dict (its DTensor shards, nothing gathered), cast to
                 the checkpoint's dtype
                 --> torch.distributed.checkpoint.save with HuggingFaceStorageWriter:
                     <staging>/sharded/shard-0000R-model-00001-of-00001.safetensors
    rank 0       consolidation (torch's, in the same save): the shards streamed
                 tensor by tensor into <staging>/model-00001-of-00001.safetensors
                 and model.safetensors.index.json
    rank 0       publish_checkpoint(weights_from=<staging>) moves those two files
                 into the checkpoint it seals with its SHA-256 manifest
                 (trainer/checkpoint.py), then removes the staging directory

Staging puts the model through the shared filesystem three times (the shards
written, read back and written again, consolidated) before it is read once more
to be hashed, and the checkpoint is always full; gathering writes it once, or
only its delta.  The staging directory is a hidden sibling of the checkpoint,
named after it, so every rank computes the same path on the shared filesystem
and a leftover of a killed attempt is removed before the next one writes.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist

from coordinator.storage.fsio import remove_tree
from trainer import memory_room
from trainer.checkpoint import cast_state
from trainer.distributed import DistContext

log = logging.getLogger("trainer")

# Rank 0 gathers the model only with this much free memory besides it: the
# tensors a full publication's save_pretrained holds while it writes, and room
# for the rest of the process.
_GATHER_SPARE: Final = 1 << 30
_GATHER_SPARE_SHARE: Final = 0.25


class Route(enum.Enum):
    GATHER = "gather"  # every tensor all-gathered onto rank 0, published as one process does
    STAGE = "stage"  # every rank's shards through a staging directory on the share


def staging_dir(out_dir: Path) -> Path:
    return out_dir.with_name(f".staging-{out_dir.name}")


def published_bytes(model: Any, dtype: str | None) -> int:
    """The bytes of `model`'s state in the checkpoint's `dtype` (its floating tensors;
    None: as they are), each tensor once (tied embeddings are one)."""
    target = getattr(torch, dtype) if dtype is not None else None
    total = 0
    for tensor in _unique(model).values():
        size = tensor.element_size()
        if target is not None and tensor.is_floating_point():
            size = torch.empty((), dtype=target).element_size()
        total += tensor.numel() * size
    return total


def gather_fits(need: int, available: int) -> bool:
    """Whether `need` bytes of gathered tensors leave their spare in `available`."""
    return available >= need + max(_GATHER_SPARE, int(need * _GATHER_SPARE_SHARE))


def choose_route(model: Any, ctx: DistContext, dtype: str | None,
                 free: Callable[[], int] | None = None) -> Route:
    """GATHER where the published model fits in rank 0's free memory (`free()`: the
    bytes it may still allocate, its cgroup's limit counted: trainer/memory_room.py),
    else STAGE; rank 0 decides and every rank takes its answer.  Collective."""
    decision: list[str | None] = [None]
    if ctx.rank == 0:
        need = published_bytes(model, dtype)
        free_bytes = (free or memory_room.available_bytes)()
        route = Route.GATHER if gather_fits(need, free_bytes) else Route.STAGE
        log.info("publishing by %s: the model is %.2f GB in %s, rank 0 has %.2f GB free%s",
                 route.value, need / 1e9, dtype or "its own dtypes", free_bytes / 1e9,
                 "" if route is Route.GATHER else
                 " (too little to gather it: every rank's shards go through a staging "
                 "directory on the share, and the checkpoint is full)")
        decision = [route.value]
    dist.broadcast_object_list(decision, src=0)
    return Route(str(decision[0]))


def _unique(model: Any) -> dict[str, Any]:
    """`model.state_dict()` with each parameter under its first name only."""
    params = dict(model.named_parameters(remove_duplicate=False))
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        key = id(params[name]) if name in params else id(tensor)
        if key not in seen:
            seen.add(key)
            out[name] = tensor
    return out


def gather_published(model: Any, ctx: DistContext, dtype: str | None) -> dict[str, Any] | None:
    """Every tensor of `model`'s state in the checkpoint's `dtype`, whole and in CPU
    memory, on rank 0 (None on the others).  Each rank casts its own shard, then the
    tensor is all-gathered.  A parameter under two names (tied embeddings) is kept
    under its first only, as save_pretrained writes a model's own state; given both,
    it would write the matrix twice.  Collective: every rank walks the same state in
    the same order."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    with torch.no_grad():
        for name, tensor in _unique(model).items():
            part = cast_state({name: tensor.detach()}, dtype)[name] if dtype else tensor
            whole = part.full_tensor() if isinstance(part, DTensor) else part
            if ctx.rank == 0:
                out[name] = whole.to("cpu", copy=True)
            del whole
    if ctx.rank == 0:
        log.info("rank 0: %d tensors gathered, %.2f GB", len(out),
                 sum(t.nbytes for t in out.values()) / 1e9)
        return out
    return None


def stage_sharded_weights(model: Any, ctx: DistContext, out_dir: Path,
                          dtype: str | None = None) -> Path:
    """Every rank writes its shards (in `dtype`, the checkpoint's: trainer/checkpoint.py
    saved_dtype; None: the parameters'); rank 0 consolidates them.  Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    staging = staging_dir(out_dir)
    if ctx.rank == 0:
        remove_tree(staging)  # a killed attempt's leftovers
    dist.barrier()
    # A tied parameter once, under its first name, as save_pretrained writes it
    # (safetensors refuses two names of one storage).
    first = _unique(model)
    state = {k: v for k, v in get_model_state_dict(model).items() if k in first}
    if dtype is not None:
        state = cast_state(state, dtype)  # each rank casts its own shards
    writer = HuggingFaceStorageWriter(str(staging), save_distributed=True,
                                      enable_consolidation=True,
                                      fqn_to_index_mapping={name: 1 for name in state})
    dcp.save(state, storage_writer=writer)
    dist.barrier()  # the consolidated file is complete before rank 0 publishes it
    log.info("rank %d: shards saved, consolidated in %s", ctx.rank, staging)
    return staging


def published_weights(model: Any, ctx: DistContext, out_dir: Path,
                      dtype: str | None) -> tuple[dict[str, Any] | None, Path | None]:
    """What rank 0 publishes the FSDP2 `model`'s checkpoint `out_dir` from, as
    publish_checkpoint's `state_dict` and `weights_from`: the gathered tensors (None on
    the other ranks), or the staging directory.  Collective."""
    if choose_route(model, ctx, dtype) is Route.GATHER:
        return gather_published(model, ctx, dtype), None
    return None, stage_sharded_weights(model, ctx, out_dir, dtype)

