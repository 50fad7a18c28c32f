"""Saving an FSDP2 model as a Hugging Face checkpoint without gathering it on one rank.

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

The staging directory is a hidden sibling of the checkpoint, named after it, so
every rank computes the same path on the shared filesystem and a leftover of
a killed attempt is removed before the next one writes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from coordinator.storage.fsio import remove_tree
from trainer.checkpoint import cast_state
from trainer.distributed import DistContext

log = logging.getLogger("trainer")


def staging_dir(out_dir: Path) -> Path:
    return out_dir.with_name(f".staging-{out_dir.name}")


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
    state = get_model_state_dict(model)
    if dtype is not None:
        state = cast_state(state, dtype)  # each rank casts its own shards
    writer = HuggingFaceStorageWriter(str(staging), save_distributed=True,
                                      enable_consolidation=True,
                                      fqn_to_index_mapping={name: 1 for name in state})
    dcp.save(state, storage_writer=writer)
    dist.barrier()  # the consolidated file is complete before rank 0 publishes it
    log.info("rank %d: shards saved, consolidated in %s", ctx.rank, staging)
    return staging
