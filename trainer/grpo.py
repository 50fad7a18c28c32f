"""The GRPO objective as pure tensor functions: no I/O, no process group.

GRPO samples a group of responses per prompt and uses each response's reward
relative to its group as the advantage, so no value model is needed:

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

Every token the model generated in sample i shares A_i (a multi-turn
episode's environment and template tokens are context: masked out of the
loss and out of every count below).  The policy loss is PPO's clipped
surrogate per token, against the log-probabilities of the policy that
generated the data ("old"):

    ratio = exp(logp - old_logp)
    loss_t = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)

Losses are summed over tokens and divided by a caller-given normaliser
counted over the whole optimizer step (all ranks, all micro-batches), so that
gradient accumulation and data parallelism give the same gradient as one big
batch.  Two normalisations are offered (TrainConfig.loss_agg):

    token-mean           sum over tokens / the model's tokens in the step (DAPO)
    seq-mean-token-mean  each response's mean over its model tokens, summed /
                         samples in the step (the GRPO paper); every response
                         weighs the same, however long its environment turns

`plan_steps` decides, identically on every rank and without communication,
which samples each rank runs in which micro-batch of which optimizer step.

Layout: prompt and response are concatenated and right-padded.  Token-level
tensors are over *targets*, i.e. shape [B, T-1] where column t is the
log-probability of input_ids[:, t+1] given the tokens up to t.  The response
of a sample with prompt length P and response length R occupies target
columns P-1 .. P+R-2.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch
from torch import Tensor

from trainer.config import TrainConfig

# exp() of a log-ratio above this overflows float32 to inf, and inf * 0
# advantage is NaN; beyond it the ratio is clipped away anyway.
_MAX_LOG_RATIO: Final = 20.0


def group_advantages(rewards: Tensor, group_index: Tensor, *, eps: float = 1e-6) -> Tensor:
    """(r - group mean) / (group std + eps), std with Bessel's correction as in verl and TRL.

    A group of one sample has no baseline to compare with: its advantage is 0.
    `group_index` may hold any integer ids; samples with the same id form a group.
    """
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} "
            "must be 1-D and the same length: one entry per sample"
        )
    rewards = rewards.to(torch.float64)  # group sums of many rewards stay exact
    _, inverse = torch.unique(group_index, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(groups, dtype=torch.float64).index_add_(
        0, inverse, torch.ones_like(rewards)
    )
    total = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, rewards)
    mean = total / count
    centred = rewards - mean[inverse]
    sq = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, centred * centred)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    adv = centred / (std[inverse] + eps)
    adv = torch.where(count[inverse] > 1, adv, torch.zeros_like(adv))
    return adv.to(torch.float32)


@dataclass(frozen=True)
class PackedBatch:
    """Prompt + response, right-padded.  response_mask is over targets: [B, T-1]."""

    input_ids: Tensor  # [B, T] long
    attention_mask: Tensor  # [B, T] long, 1 for real tokens
    response_mask: Tensor  # [B, T-1] float, 1 where the target is a token the model wrote
    prompt_lens: tuple[int, ...]
    response_lens: tuple[int, ...]  # every response token, environment turns included
    model_lens: tuple[int, ...]  # the response tokens the model wrote: what the loss counts


def collate(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], *, pad_id: int,
    loss_masks: Sequence[Sequence[bool]] | None = None,
) -> PackedBatch:
    """Concatenate each prompt with its response and right-pad to the longest.

    `loss_masks` (per response token) leaves the environment's and the chat
    template's tokens of a multi-turn episode out of response_mask, hence out
    of the loss: they are context, not actions.
    """
    if len(prompt_ids) != len(response_ids) or not prompt_ids:
        raise ValueError(
            f"got {len(prompt_ids)} prompts and {len(response_ids)} responses: "
            "need the same, non-zero number"
        )
    rows = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("a prompt has no tokens: the first response token needs a context")
    width = max(2, max(len(row) for row in rows))
    batch = len(rows)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    response_mask = torch.zeros((batch, width - 1), dtype=torch.float32)
    for b, (p, r, row) in enumerate(zip(prompt_ids, response_ids, rows, strict=True)):
        input_ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention[b, : len(row)] = 1
        response_mask[b, len(p) - 1 : len(p) - 1 + len(r)] = 1.0 if loss_masks is None \
            else torch.tensor(loss_masks[b], dtype=torch.float32)
    return PackedBatch(
        input_ids=input_ids,
        attention_mask=attention,
        response_mask=response_mask,
        prompt_lens=tuple(len(p) for p in prompt_ids),
        response_lens=tuple(len(r) for r in response_ids),
        model_lens=tuple(int(n) for n in response_mask.sum(dim=1).tolist()),
    )


def token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """log p(input_ids[:, t+1] | prefix) for every t: [B, T-1], computed in float32."""
    targets = input_ids[:, 1:]
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def place_response_values(values: Sequence[Tensor], batch: PackedBatch) -> Tensor:
    """Put each sample's per-response-token values at its response columns: [B, T-1]."""
    width = batch.response_mask.shape[1]
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for b, (v, p, r) in enumerate(zip(values, batch.prompt_lens, batch.response_lens, strict=True)):
        if v.numel() != r:
            raise ValueError(f"sample {b} has {v.numel()} values for {r} response tokens")
        out[b, p - 1 : p - 1 + r] = v.to(torch.float32)
    return out


def extract_response_values(token_values: Tensor, batch: PackedBatch) -> list[Tensor]:
    """The inverse of place_response_values: one 1-D tensor per sample."""
    return [
        token_values[b, p - 1 : p - 1 + r].detach().clone()
        for b, (p, r) in enumerate(zip(batch.prompt_lens, batch.response_lens, strict=True))
    ]


@dataclass(frozen=True)
class LossTerms:
    """Sums over masked tokens (not means), so callers can add them across ranks."""

    loss: Tensor  # differentiable, already divided by the normaliser
    policy_sum: Tensor  # sum of per-token clipped surrogate losses
    kl_sum: Tensor  # sum of per-token k3 KL estimates (0 when KL is off)
    clipped_tokens: Tensor  # tokens where the clip bound was the active term
    ratio_sum: Tensor
    tokens: Tensor


def clipped_policy_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_eps: float
) -> tuple[Tensor, Tensor]:
    """Per-token PPO clipped surrogate (to minimise) and where the clip was active, both [B, T-1]."""
    log_ratio = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped) * mask
    clip_active = (clipped < unclipped).to(mask.dtype) * mask
    return per_token, clip_active


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || ref): exp(d) - d - 1 with d = ref - logp.

    Unbiased for samples from the policy and always >= 0 (Schulman's "Approximating
    KL divergence"); it is what GRPO adds to the loss.
    """
    d = (ref_logp - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(d) - d - 1.0


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float,
    normalizer: float,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    sample_weights: Tensor | None = None,
    is_weights: Tensor | None = None,
) -> LossTerms:
    """Clipped policy loss plus kl_coef * k3 KL, summed over masked tokens / normalizer.

    `sample_weights` ([B]) scales every token of a sample: 1 / its model tokens
    with the number of samples as normaliser gives the per-sequence mean.
    `is_weights` ([B, T-1], no gradient) scales each token's policy loss: the
    truncated importance weight of an off-policy batch (`truncated_is_weights`).
    The returned sums (policy_sum, kl_sum, ...) are unweighted token sums.
    """
    if normalizer <= 0:
        raise ValueError(f"normalizer={normalizer} must be > 0: count the step's model tokens")
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask "
            f"{tuple(mask.shape)} must have the same [B, T-1] shape"
        )
    per_token, clip_active = clipped_policy_loss(
        logp, old_logp, advantages, mask, clip_eps=clip_eps
    )
    kl_token = (
        kl_k3(logp, ref_logp) * mask
        if ref_logp is not None and kl_coef > 0
        else torch.zeros_like(per_token)
    )
    weight = 1.0 if sample_weights is None else sample_weights.to(logp.dtype).unsqueeze(-1)
    policy = per_token if is_weights is None else per_token * is_weights.detach().to(logp.dtype)
    total = ((policy + kl_coef * kl_token) * weight).sum()
    with torch.no_grad():
        ratio_sum = (torch.exp((logp - old_logp).clamp(max=_MAX_LOG_RATIO)) * mask).sum()
    return LossTerms(
        loss=total / normalizer,
        policy_sum=per_token.sum().detach(),
        kl_sum=kl_token.sum().detach(),
        clipped_tokens=clip_active.sum().detach(),
        ratio_sum=ratio_sum,
        tokens=mask.sum().detach(),
    )


def truncated_is_weights(old_logp: Tensor, behaviour_logp: Tensor, *, cap: float) -> Tensor:
    """min(pi_old / pi_behaviour, cap) per token: truncated importance sampling (TIS).

    The batch was sampled by the engine's policy (behaviour, perhaps some
    versions old); PPO's ratio is taken against the trainer's recomputed
    `old_logp`.  The weight corrects for the gap and is capped so that one
    token the engine found unlikely cannot dominate the step (AReaL's decoupled
    loss; verl, SkyRL and prime-rl cap the same way)."""
    if cap < 1:
        raise ValueError(f"cap={cap} must be >= 1: the most one token's weight may count")
    log_ratio = (old_logp - behaviour_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(log_ratio).clamp(max=cap)


@dataclass(frozen=True, kw_only=True)
class Step:
    """One optimizer step: for each rank, its micro-batches (lists of sample indices)."""

    micro: tuple[tuple[tuple[int, ...], ...], ...]  # [rank][micro] -> sample indices
    tokens: int  # the model's tokens in the step over all ranks: the token-mean normaliser
    samples: int  # samples in the step over all ranks: the sequence-mean normaliser


def shard(num_samples: int, world: int, rank: int) -> list[int]:
    """Rank r owns samples r, r + world, ...: groups spread over ranks, sizes differ by <= 1."""
    return list(range(rank, num_samples, world))


def plan_steps(
    model_tokens: Sequence[int], *, world: int, config: TrainConfig, iteration: int
) -> list[Step]:
    """Every rank's micro-batches for every optimizer step, the same on every rank.

    `model_tokens` counts, per sample, the tokens the model generated
    (TrainBatch.model_token_counts): the environment's and the template's
    tokens of a multi-turn episode carry no loss and must not dilute it.

    Each epoch reshuffles each shard with an RNG seeded by (seed, iteration,
    epoch), so the plan is reproducible and needs no communication.
    """
    n = len(model_tokens)
    shards = [shard(n, world, r) for r in range(world)]
    longest = max(len(s) for s in shards)
    mini = config.mini_batch_size or n
    per_rank = max(1, math.ceil(mini / world))
    steps = []
    for epoch in range(config.epochs):
        rng = random.Random(f"{config.seed}/{iteration}/{epoch}")
        order = [rng.sample(s, len(s)) for s in shards]
        for start in range(0, max(longest, 1), per_rank):
            chunks = [o[start : start + per_rank] for o in order]
            n_micro = max(1, max(math.ceil(len(c) / config.micro_batch_size) for c in chunks))
            micro = tuple(
                tuple(
                    tuple(c[m * config.micro_batch_size : (m + 1) * config.micro_batch_size])
                    for m in range(n_micro)
                )
                for c in chunks
            )
            tokens = sum(model_tokens[i] for c in chunks for i in c)
            samples = sum(len(c) for c in chunks)
            steps.append(Step(micro=micro, tokens=tokens, samples=samples))
    return steps
