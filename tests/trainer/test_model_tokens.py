"""The loss and the per-token metrics count only the tokens the model wrote.

A multi-turn episode's response holds the model's turns and, between them, the
environment's and the chat template's tokens (response_mask false).  Those are
context: they carry no loss, and they must not count in the loss's normaliser
either, or a batch with tool output trains with a gradient scaled down by
(model tokens / all tokens) and an episode with long environment turns weighs
less than a short answer.  Here the trainer's real path (plan_steps,
update.plan, optimizer_step on a tiny Llama) is compared with the gradient computed from
the model's tokens alone, one sample at a time, without padding.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rollout.batch_format import TrainBatch
from trainer import grpo
from trainer.config import LossAgg, Strategy, TrainConfig
from trainer.distributed import DistContext
from trainer.job import TrainJob
from trainer.policy import policy_logprobs
from trainer.tiny_model import PAD_ID, TinyModelSpec, llama_config_dict
from trainer.train import Progress, fixed_inputs, iteration_metrics
from trainer.update import Inputs, optimizer_step, plan

CTX = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                  strategy=Strategy.DDP)
# Group 0: a multi-turn episode (model, environment + template, model) beside a
# single-turn answer; group 1: two single-turn answers.
PROMPTS = [[1, 5, 6], [1, 5, 6], [1, 7, 8], [1, 7, 8]]
RESPONSES = [[9, 10, 30, 31, 32, 33, 34, 35, 11, 12], [9, 13], [14, 15, 16], [17]]
MASKS = [[1, 1, 0, 0, 0, 0, 0, 0, 1, 1], [1, 1], [1, 1, 1], [1]]
REWARDS = [1.0, 0.0, 0.0, 1.0]


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2)
    return LlamaForCausalLM(LlamaConfig(**llama_config_dict(spec))).float()


def make_batch(engine_logprobs: list[list[float]] | None = None) -> TrainBatch:
    return TrainBatch.from_lists(
        iteration=1, group_size=2, task_ids=["a", "a", "b", "b"],
        group_index=torch.tensor([0, 0, 1, 1]), prompt_ids=PROMPTS, response_ids=RESPONSES,
        old_logprobs=engine_logprobs or [[-1.0] * len(r) for r in RESPONSES],
        rewards=torch.tensor(REWARDS), response_masks=MASKS)


def model_tokens_gradient(model: torch.nn.Module, advantages: torch.Tensor,
                          agg: LossAgg) -> list[torch.Tensor]:
    """The on-policy GRPO gradient from the model's tokens alone: each sample on its own
    (no padding), its log-probs taken at the model's tokens only, and averaged over
    those tokens (token-mean) or over each sample's model tokens, then samples."""
    model.zero_grad(set_to_none=True)
    total_model_tokens = sum(sum(m) for m in MASKS)
    loss = torch.zeros(())
    for i, (prompt, response, mask) in enumerate(zip(PROMPTS, RESPONSES, MASKS, strict=True)):
        ids = torch.tensor([prompt + response])
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1], -1)
        targets = ids[0, 1:]
        per_target = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        mine = [len(prompt) - 1 + t for t, keep in enumerate(mask) if keep]
        chosen = per_target[mine]
        # On-policy: ratio = 1 with gradient d(ratio) = d(logp), never clipped.
        surrogate = -(advantages[i] * torch.exp(chosen - chosen.detach())).sum()
        loss = loss + (surrogate / len(mine) if agg is LossAgg.SEQ_MEAN_TOKEN_MEAN
                       else surrogate)
    loss = loss / (len(PROMPTS) if agg is LossAgg.SEQ_MEAN_TOKEN_MEAN else total_model_tokens)
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def test_the_batch_counts_each_samples_model_tokens_apart_from_its_context() -> None:
    batch = make_batch()
    assert batch.model_token_counts == [4, 2, 3, 1]
    assert batch.response_lengths.tolist() == [10, 2, 3, 1]
    packed = grpo.collate(PROMPTS[:2], RESPONSES[:2], pad_id=PAD_ID,
                          loss_masks=[[bool(k) for k in m] for m in MASKS[:2]])
    assert packed.model_lens == (4, 2) and packed.response_lens == (10, 2)


@pytest.mark.parametrize("agg", list(LossAgg))
def test_a_multi_turn_episode_trains_with_the_gradient_of_the_models_tokens_alone(
    agg: LossAgg,
) -> None:
    model = tiny_llama()
    batch = make_batch()
    config = TrainConfig(loss_agg=agg, micro_batch_size=2, mini_batch_size=0, epochs=1,
                         max_grad_norm=1e6, lr=1e-3, warmup_steps=0)
    advantages = grpo.group_advantages(batch.rewards, batch.group_index)
    expected = model_tokens_gradient(model, advantages, agg)

    steps = plan(batch, world=1, config=config, iteration=1)
    assert len(steps) == 1 and steps[0].tokens == 10  # 4 + 2 + 3 + 1, not 16
    own = grpo.shard(batch.num_samples, 1, 0)
    old = policy_logprobs(model, batch, own, CTX, config.micro_batch_size, PAD_ID)
    inputs = Inputs(batch=batch, advantages=advantages, old=old, ref=None, tis=None, own=own,
                    pad_id=PAD_ID)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    optimizer_step(model, optimizer, steps[0], inputs, CTX, config, total_steps=1)
    got = [p.grad for p in model.parameters() if p.grad is not None]

    assert len(got) == len(expected)
    got_flat, expected_flat = torch.cat([g.flatten() for g in got]), \
        torch.cat([e.flatten() for e in expected])
    assert float(expected_flat.norm()) > 0
    # Padding and micro-batching change float rounding only; a wrong normaliser
    # (the 16 response tokens, or 10 for the episode's mean) is off by 30 % or more.
    assert float((got_flat - expected_flat).norm()) <= 1e-4 * float(expected_flat.norm())


def test_the_importance_weight_and_mismatch_metrics_average_over_the_models_tokens(
    tmp_path: Path,
) -> None:
    model = tiny_llama()
    own = [0, 1, 2, 3]
    recomputed = policy_logprobs(model, make_batch(), own, CTX, 8, PAD_ID)
    # The engine's log-probs: every model token log(1.5) below the trainer's, so
    # each importance weight is 1.5; the environment's tokens hold 0.0, as an
    # agent records tokens it did not sample (they are no one's log-probs).
    gap = math.log(1.5)
    engine = [[float(v) - gap if keep else 0.0 for v, keep in zip(recomputed[i], MASKS[i],
                                                                  strict=True)]
              for i in own]
    batch = make_batch(engine)
    config = TrainConfig(micro_batch_size=8, tis_cap=2.0)
    job = TrainJob(iteration=1, model_dir=tmp_path, ref_model_dir=None,
                   batch_path=tmp_path / "batch.pt", out_dir=tmp_path / "out",
                   state_dir=tmp_path / "state", metrics_path=tmp_path / "metrics.json",
                   config=config, off_policy=True)
    inputs, mismatch = fixed_inputs(job, CTX, model, batch, True, PAD_ID)
    metrics = iteration_metrics(job, CTX, inputs, Progress(), mismatch, 0)
    assert metrics["tokens"] == 10
    assert metrics["tis_weight_mean"] == pytest.approx(1.5, rel=1e-5)
    assert metrics["tis_truncated_fraction"] == 0.0
    assert metrics["logprob_mismatch_mean_abs"] == pytest.approx(gap, rel=1e-4)
