"""The policy model during training: loading, forward passes and log-probs.

`load_model` reads a verified checkpoint as fp32 master weights;
`forward_logits` runs it under the compute dtype the DistContext chose;
`policy_logprobs` gives per-response-token log-probs without grad (the PPO
"old" policy and the KL reference); `param_digest` fingerprints the weights so
ranks can be compared.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import math
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import torch
from torch import Tensor

from coordinator import routing
from coordinator.storage import trees
from rollout.batch_format import TrainBatch
from trainer import grpo
from trainer.checkpoint import MANIFEST_NAME, read_manifest, verify_checkpoint
from trainer.config import Strategy
from trainer.distributed import DistContext, unwrap, wrap_model
from trainer.errors import TrainError
from trainer.grpo import shard
from trainer.local_copy import held_copy, remove_others
from trainer.local_view import local_view

log = logging.getLogger("trainer")
# Under TMPDIR: the checkpoint a trainer loaded as its policy, and as its reference.
POLICIES: Final = "policies"
REFERENCE: Final = "reference"


@contextlib.contextmanager
def readable(model_dir: Path, cache: str = POLICIES) -> Iterator[Path]:
    """A model directory checked and readable as local files while the block reads it.

    A published checkpoint (its manifest beside it) is copied into this process's
    TMPDIR (the run's node-local .tmp/), under `cache`, hashed as it is copied
    (trainer/local_copy.py): one read of the share per node, whatever the number of
    local ranks (the first copies under the cache's lock, the others find it
    sealed), where each rank used to read it twice, its check then its load.  A
    delta checkpoint is made whole there, in a clone of its parent's copy (never
    advanced in place: a process that loaded it may still map its file).  The copy
    is held while the block reads it; the cache's other copies go after (a removed
    file stays readable to whoever maps it): a trainer started each iteration keeps
    one model there, not one more per iteration.  A full checkpoint with no room
    for its copy is checked and read where it is (logged).  From a bucket, a full
    checkpoint is fetched to the node-local root instead (trainer/local_view.py); a
    user's own directory (no manifest) is read as it is."""
    if not trees.exists(model_dir / MANIFEST_NAME):
        if not model_dir.is_dir():
            raise TrainError(f"model_dir {model_dir} does not exist")
        yield model_dir
        return
    full = read_manifest(model_dir).delta is None
    if full and routing.routed(model_dir) is not None:
        yield local_view(model_dir)
        return
    root = Path(tempfile.gettempdir()) / cache
    with contextlib.ExitStack() as stack:
        try:
            copy = stack.enter_context(held_copy(model_dir, root))
        except OSError as exc:
            if not full or exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            log.warning("no room in %s for a copy of %s (%s): checking it and reading it "
                        "where it is, twice; give TMPDIR (or checkpoint.local_cache) room for "
                        "one more model", root, model_dir, exc)
            verify_checkpoint(model_dir)
            yield model_dir
            return
        yield copy
    for old, gone in remove_others(root, copy):
        log.info("%s %s", "removed the older copy" if gone
                 else "kept the older copy another process reads:", old)


def load_model(model_dir: Path, ctx: DistContext, dtype: torch.dtype = torch.float32,
               cache: str = POLICIES) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with readable(model_dir, cache) as files:
        # fp32 weights unless asked (train.param_dtype); FSDP2 casts to bf16 for compute.
        model = AutoModelForCausalLM.from_pretrained(
            files, dtype=dtype, local_files_only=True, use_safetensors=True
        )
        tokenizer = AutoTokenizer.from_pretrained(files, local_files_only=True)
    model.to(ctx.device)  # type: ignore[arg-type]  # transformers' stub is wrong
    model.config.use_cache = False  # no KV cache while training
    return model, tokenizer


def enable_checkpointing(model: Any) -> None:
    """Activation checkpointing per decoder layer (transformers' own, non-reentrant;
    `activation_checkpointing_enable` since transformers 5, the older name before)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def load_policy(model_dir: Path, ctx: DistContext, *, trainable: bool,
                dtype: torch.dtype = torch.float32,
                checkpointing: bool = False) -> tuple[Any, Any]:
    """The model ready to train (or, not `trainable`, frozen for reference log-probs)
    and its tokenizer.  Under FSDP2 each rank reads only its own shards
    (trainer/sharded_load.py); otherwise the whole model, wrapped for DDP."""
    cache = POLICIES if trainable else REFERENCE
    if not (ctx.is_distributed and ctx.strategy == Strategy.FSDP2):
        model, tokenizer = load_model(model_dir, ctx, dtype, cache)
        model.train(trainable)
        if checkpointing:
            enable_checkpointing(model)
        return wrap_model(model, ctx, trainable=trainable), tokenizer
    from transformers import AutoTokenizer

    from trainer.sharded_load import load_sharded_model

    with readable(model_dir, cache) as files:
        wrapped = load_sharded_model(files, ctx, trainable=trainable, dtype=dtype,
                                     prepare=enable_checkpointing if checkpointing else None)
        tokenizer = AutoTokenizer.from_pretrained(files, local_files_only=True)
    wrapped.train(trainable)
    return wrapped, tokenizer


def autocast(ctx: DistContext) -> contextlib.AbstractContextManager[Any]:
    """bf16 compute for DDP/single process; FSDP2 casts through its own policy."""
    if ctx.compute_dtype == torch.float32 or (
        ctx.is_distributed and ctx.strategy == Strategy.FSDP2
    ):
        return contextlib.nullcontext()
    return torch.autocast(device_type=ctx.device.type, dtype=ctx.compute_dtype)


def forward_logits(model: Any, packed: grpo.PackedBatch, ctx: DistContext) -> Tensor:
    with autocast(ctx):
        out = model(
            input_ids=packed.input_ids.to(ctx.device),
            attention_mask=packed.attention_mask.to(ctx.device),
            use_cache=False,
        )
    return out.logits


def pack(batch: TrainBatch, idx: Sequence[int], pad_id: int) -> grpo.PackedBatch:
    """Right-padded prompt+response rows of the samples `idx`, ready for a forward."""
    return grpo.collate(
        [batch.prompt_ids[i] for i in idx], [batch.response_ids[i] for i in idx], pad_id=pad_id,
        loss_masks=[batch.response_masks[i] for i in idx],
    )


def policy_logprobs(
    model: Any, batch: TrainBatch, own: Sequence[int], ctx: DistContext, micro: int, pad_id: int
) -> dict[int, Tensor]:
    """Per-response-token log-probs of `own` samples under `model`, without grad.

    All ranks run the same number of forwards (FSDP2 all-gathers inside).
    """
    longest = len(shard(batch.num_samples, ctx.world_size, 0))  # rank 0's shard is the largest
    out: dict[int, Tensor] = {}
    with torch.no_grad():
        for m in range(max(1, math.ceil(longest / micro))):
            chunk = list(own[m * micro : (m + 1) * micro])
            idx = chunk or [0]  # a throwaway forward keeps the collectives in step
            packed = pack(batch, idx, pad_id)
            logits = forward_logits(model, packed, ctx)
            logp = grpo.token_logprobs(logits, packed.input_ids.to(ctx.device)).cpu()
            for i, values in zip(chunk, grpo.extract_response_values(logp, packed), strict=False):
                out[i] = values
    return out


@contextlib.contextmanager
def as_published(model: Any, dtype: str) -> Iterator[None]:
    """The model's parameters rounded to `dtype` (the checkpoint's) for the block, then
    restored exactly: what scores the probes is what the engines will load.

    The fp32 values wait in CPU memory (this rank's shards under FSDP2); parameters
    already in `dtype` (bf16 ones with fp32 copies in the optimizer) are untouched.
    """
    target = getattr(torch, dtype)
    kept: list[tuple[Tensor, Tensor]] = []
    try:
        with torch.no_grad():
            for p in unwrap(model).parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                if local.dtype == target or not local.is_floating_point():
                    continue
                kept.append((local, local.detach().to("cpu", copy=True)))
                local.copy_(local.to(target))
        yield
    finally:
        with torch.no_grad():
            for local, original in kept:
                local.copy_(original)


def param_digest(model: Any) -> str:
    """sha256 over all (full) parameters: equal on every rank when replicas agree."""
    digest = hashlib.sha256()
    for name, p in sorted(unwrap(model).named_parameters()):
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        digest.update(name.encode())
        digest.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()
