"""One GRPO optimizer step: micro-batches, loss, backward, clip, AdamW.

`optimizer_step` is the body of the update loop in `trainer.train.run`; it
reads the iteration's fixed `Inputs` (advantages, old and reference
log-probs) and returns this rank's `Sums`, which the caller adds over ranks.
Every rank runs the same number of forward/backward passes: a rank short of
samples runs a zero-weight copy of a real one, because DDP and FSDP2 issue
collectives inside them and unequal counts would hang.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from rollout.batch_format import TrainBatch
from trainer import grpo
from trainer.config import LossAgg, TrainConfig
from trainer.distributed import DistContext, all_reduce, grad_sync
from trainer.errors import TrainError
from trainer.policy import forward_logits, pack


@dataclass
class Sums:
    """Token sums over the iteration, added over ranks before they become means."""

    loss: float = 0.0  # the objective as optimised (already normalised)
    kl: float = 0.0
    clipped: float = 0.0
    ratio: float = 0.0
    tokens: float = 0.0

    def add(self, terms: grpo.LossTerms) -> None:
        self.loss += float(terms.loss.detach())
        self.kl += float(terms.kl_sum)
        self.clipped += float(terms.clipped_tokens)
        self.ratio += float(terms.ratio_sum)
        self.tokens += float(terms.tokens)

    def merge(self, other: Sums) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def reduced(self, ctx: DistContext) -> Sums:
        return Sums(*all_reduce([getattr(self, f.name) for f in fields(self)], ctx))


@dataclass(frozen=True, kw_only=True)
class Inputs:
    """What the optimizer steps read: advantages and the per-sample reference values."""

    batch: TrainBatch
    advantages: Tensor  # [S]
    old: dict[int, Tensor]  # recomputed "old" log-probs of this rank's samples
    ref: dict[int, Tensor] | None  # reference log-probs (KL on) of this rank's samples
    # off-policy batches: truncated importance weights of this rank's samples
    tis: dict[int, Tensor] | None
    own: list[int]
    pad_id: int


def plan(batch: TrainBatch, *, world: int, config: TrainConfig,
         iteration: int) -> list[grpo.Step]:
    """The iteration's optimizer steps (grpo.plan_steps), their token-mean normalisers
    counting only the tokens the model generated: a multi-turn episode's environment
    and template tokens are context, masked out of the loss and out of its mean."""
    return grpo.plan_steps(batch.model_token_counts, world=world, config=config,
                           iteration=iteration)


def optimizer_step(
    wrapped: Any,
    optimizer: Any,
    step: grpo.Step,
    inputs: Inputs,
    ctx: DistContext,
    config: TrainConfig,
    total_steps: int,
) -> tuple[Sums, float]:
    """Accumulate the step's micro-batches, clip, and apply AdamW; returns (local sums, grad norm)."""
    sums = Sums()
    optimizer.zero_grad(set_to_none=True)
    mine = step.micro[ctx.rank]
    for m, chunk in enumerate(mine):
        real = bool(chunk)
        # A rank short of samples runs a zero-weight copy of a real one: DDP
        # and FSDP2 need every rank in every backward's collectives.
        idx = list(chunk) if real else [inputs.own[0] if inputs.own else 0]
        with grad_sync(wrapped, ctx, enabled=m == len(mine) - 1):
            terms = micro_batch_loss(wrapped, step, inputs, idx, real, ctx, config)
            # DDP and FSDP2 average gradients over ranks, while the normaliser
            # already counts every rank's tokens/samples: scale the average back to a sum.
            (terms.loss * (float(ctx.world_size) if real else 0.0)).backward()
        if real:
            sums.add(terms)
    grad_norm = clip_gradients(list(wrapped.parameters()), config.max_grad_norm)
    if not math.isfinite(grad_norm):
        raise TrainError(
            f"gradient norm is {grad_norm}: lower lr (now {config.lr}) or check the batch's rewards"
        )
    for group in optimizer.param_groups:
        group["lr"] = config.lr_at(total_steps)
    optimizer.step()
    return sums, grad_norm


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the gradients to `max_norm` in total and return their norm before it,
    taken in float32 whatever the gradients' dtype: bf16 parameters
    (train.param_dtype) have bf16 gradients, whose norm torch would take, and
    report, in bf16 (about 0.4 % off).  One tensor at a time is cast, never the
    whole model's gradients at once."""
    grads = [p.grad for p in params if p.grad is not None]
    if all(g.dtype == torch.float32 for g in grads):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    norms = [torch.linalg.vector_norm(g.float()) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def micro_batch_loss(
    wrapped: Any,
    step: grpo.Step,
    inputs: Inputs,
    idx: list[int],
    real: bool,
    ctx: DistContext,
    config: TrainConfig,
) -> grpo.LossTerms:
    """The GRPO loss of the samples `idx`, normalised over the whole step.

    A stand-in micro-batch (`real` false) is its own "old" policy and has no
    reference values: its loss only keeps this rank in the collectives.
    """
    packed = pack(inputs.batch, idx, inputs.pad_id)
    logits = forward_logits(wrapped, packed, ctx)
    logp = grpo.token_logprobs(logits, packed.input_ids.to(ctx.device))
    if real:
        old = grpo.place_response_values([inputs.old[i] for i in idx], packed)
    else:
        old = logp.detach().cpu()
    ref = None
    if inputs.ref is not None and real:
        ref = grpo.place_response_values([inputs.ref[i] for i in idx], packed).to(ctx.device)
    tis = None
    if inputs.tis is not None and real:
        tis = grpo.place_response_values([inputs.tis[i] for i in idx], packed).to(ctx.device)
    # Only the model's own tokens count: a multi-turn episode's environment and
    # template tokens are masked out of the loss and must not dilute its mean.
    if config.loss_agg == LossAgg.TOKEN_MEAN:
        weights, normalizer = None, max(step.tokens, 1)
    else:
        weights = torch.tensor([1.0 / max(n, 1) for n in packed.model_lens])
        normalizer = max(step.samples, 1)
    return grpo.grpo_loss(
        logp,
        old.to(ctx.device),
        inputs.advantages[idx].to(ctx.device),
        packed.response_mask.to(ctx.device),
        clip_eps=config.clip_eps,
        normalizer=normalizer,
        ref_logp=ref,
        kl_coef=config.kl_coef,
        sample_weights=None if weights is None else weights.to(ctx.device),
        is_weights=tis,
    )
