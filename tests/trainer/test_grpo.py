"""The GRPO objective's pure functions, checked against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trainer import grpo
from trainer.config import TrainConfig


def test_advantages_are_reward_minus_group_mean_over_sample_std() -> None:
    # Group 7: rewards 1,0,0,0 -> mean 0.25, centred .75,-.25,-.25,-.25,
    # sum of squares 0.75, sample variance 0.75/3 = 0.25, std 0.5.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 9])
    adv = grpo.group_advantages(rewards, groups, eps=1e-6)
    expected = [0.75 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001]
    assert adv[:4].tolist() == pytest.approx(expected, rel=1e-6)


def test_groups_of_equal_rewards_and_singletons_get_zero_advantage() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.5, 0.0, 0.0, 0.0])
    groups = torch.tensor([3, 3, 9, 4, 4, 4])
    assert grpo.group_advantages(rewards, groups).tolist() == [0.0] * 6


def test_advantages_reject_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="same length"):
        grpo.group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def test_collate_right_pads_and_masks_response_targets_only() -> None:
    packed = grpo.collate([[1, 2], [1]], [[3, 4, 5], [6]], pad_id=0)
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5], [1, 6, 0, 0, 0]]
    assert packed.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # Target column t predicts input t+1: row 0's response (inputs 2..4) is
    # columns 1..3, row 1's single response token (input 1) is column 0.
    assert packed.response_mask.tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]
    assert packed.response_lens == packed.model_lens == (3, 1)


def test_collate_refuses_an_empty_prompt() -> None:
    with pytest.raises(ValueError, match="prompt has no tokens"):
        grpo.collate([[]], [[1]], pad_id=0)


def test_token_logprobs_gather_the_next_token() -> None:
    # Position 0 gives token 1 odds 3:1, so log p(1) = ln 0.75.
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0]]])
    logp = grpo.token_logprobs(logits, torch.tensor([[0, 1]]))
    assert logp.tolist() == [[pytest.approx(math.log(0.75), rel=1e-6)]]


def test_place_and_extract_response_values_round_trip() -> None:
    packed = grpo.collate([[1, 2], [1]], [[3, 4, 5], [6]], pad_id=0)
    values = [torch.tensor([-0.1, -0.2, -0.3]), torch.tensor([-0.4])]
    placed = grpo.place_response_values(values, packed)
    assert torch.allclose(placed, torch.tensor([[0, -0.1, -0.2, -0.3], [-0.4, 0, 0, 0]]))
    back = grpo.extract_response_values(placed, packed)
    assert [v.tolist() for v in back] == [pytest.approx(v.tolist()) for v in values]


def test_clipped_surrogate_matches_hand_computed_cases() -> None:
    # ratio 1.5 / 0.5 / 0.5 / 1.5 with advantages +1 / +1 / -1 / -1, eps 0.2:
    #   +1, 1.5: min(1.5, 1.2) = 1.2      clipped
    #   +1, 0.5: min(0.5, 0.8) = 0.5      not clipped
    #   -1, 0.5: min(-0.5, -0.8) = -0.8   clipped
    #   -1, 1.5: min(-1.5, -1.2) = -1.5   not clipped
    old = torch.log(torch.tensor([[0.4], [0.4], [0.4], [0.4]]))
    logp = (old + torch.log(torch.tensor([[1.5], [0.5], [0.5], [1.5]]))).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    mask = torch.ones(4, 1)
    per_token, clipped = grpo.clipped_policy_loss(logp, old, adv, mask, clip_eps=0.2)
    assert per_token.squeeze(1).tolist() == pytest.approx([-1.2, -0.5, 0.8, 1.5], rel=1e-5)
    assert clipped.squeeze(1).tolist() == [1.0, 0.0, 1.0, 0.0]
    per_token.sum().backward()
    # Clipped tokens get no gradient; the others get -ratio * A.
    assert logp.grad.squeeze(1).tolist() == pytest.approx([0.0, -0.5, 0.0, 1.5], rel=1e-5)


def test_k3_kl_is_zero_for_equal_policies_and_matches_the_formula() -> None:
    logp = torch.log(torch.tensor([0.5, 0.3]))
    ref = torch.log(torch.tensor([0.25, 0.3]))
    # d = ln(0.25/0.5) = -ln 2: exp(d) - d - 1 = 0.5 + ln 2 - 1.
    assert grpo.kl_k3(logp, ref).tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0], abs=1e-6)


def test_grpo_loss_sums_masked_tokens_over_the_normaliser() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.9]]))
    old = logp.clone()
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is padding
    terms = grpo.grpo_loss(
        logp, old, torch.tensor([2.0]), mask, clip_eps=0.2, normalizer=4, ref_logp=ref, kl_coef=0.1
    )
    # ratio 1 everywhere: policy sum = -2 * 2 tokens = -4; KL only on token 0.
    kl0 = 0.5 + math.log(2) - 1
    assert float(terms.policy_sum) == pytest.approx(-4.0)
    assert float(terms.kl_sum) == pytest.approx(kl0, abs=1e-6)
    assert float(terms.loss) == pytest.approx((-4.0 + 0.1 * kl0) / 4, abs=1e-6)
    assert float(terms.tokens) == 2.0
    assert float(terms.clipped_tokens) == 0.0


def test_micro_batch_losses_add_up_to_the_full_batch_loss() -> None:
    torch.manual_seed(0)
    logp, old = -torch.rand(6, 5), -torch.rand(6, 5)
    adv, mask = torch.randn(6), (torch.rand(6, 5) > 0.3).float()
    n = float(mask.sum())
    full = grpo.grpo_loss(logp, old, adv, mask, clip_eps=0.2, normalizer=n).loss
    parts = sum(
        grpo.grpo_loss(logp[s], old[s], adv[s], mask[s], clip_eps=0.2, normalizer=n).loss
        for s in (slice(0, 2), slice(2, 6))
    )
    assert float(parts) == pytest.approx(float(full), rel=1e-6)


def test_grpo_loss_rejects_a_zero_normaliser() -> None:
    z = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="normalizer=0"):
        grpo.grpo_loss(z, z, torch.zeros(1), z, clip_eps=0.2, normalizer=0)


@pytest.mark.parametrize(
    ("samples", "world", "mini", "micro"), [(10, 3, 0, 2), (7, 2, 4, 1), (2, 3, 0, 4)]
)
def test_plan_gives_every_sample_once_per_epoch_with_equal_micro_counts(
    samples: int, world: int, mini: int, micro: int
) -> None:
    lens = [i + 1 for i in range(samples)]
    config = TrainConfig(epochs=2, mini_batch_size=mini, micro_batch_size=micro)
    steps = grpo.plan_steps(lens, world=world, config=config, iteration=3)
    seen: list[int] = []
    for step in steps:
        assert len({len(per_rank) for per_rank in step.micro}) == 1  # same count on every rank
        in_step = [i for per_rank in step.micro for m in per_rank for i in m]
        assert step.tokens == sum(lens[i] for i in in_step)
        for rank, per_rank in enumerate(step.micro):
            assert all(i % world == rank for m in per_rank for i in m)
            assert all(len(m) <= micro for m in per_rank)
        seen += in_step
    assert sorted(seen) == sorted(list(range(samples)) * 2)
    assert steps == grpo.plan_steps(lens, world=world, config=config, iteration=3)


def test_plan_reshuffles_between_epochs_and_iterations() -> None:
    config = TrainConfig(epochs=2, micro_batch_size=1)
    lens = [1] * 20
    first, second = grpo.plan_steps(lens, world=1, config=config, iteration=0)
    other, _ = grpo.plan_steps(lens, world=1, config=config, iteration=1)
    assert first.micro != second.micro
    assert first.micro != other.micro


def test_tokens_masked_out_of_a_response_carry_no_loss_and_no_gradient() -> None:
    from trainer.grpo import collate, grpo_loss

    packed = collate([[1, 2]], [[5, 6, 7, 8]], pad_id=0, loss_masks=[[True, False, False, True]])
    # Targets: position 1 predicts 5 (model), 2 -> 6 and 3 -> 7 (environment), 4 -> 8 (model).
    assert packed.response_mask.tolist() == [[0.0, 1.0, 0.0, 0.0, 1.0]]
    logp = torch.full((1, 5), -1.0, requires_grad=True)
    loss = grpo_loss(logp, torch.full((1, 5), -1.0), torch.tensor([1.0]), packed.response_mask,
                     clip_eps=0.2, normalizer=2.0)
    loss.loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist()[2:4] == [0.0, 0.0] and logp.grad[0, 1] != 0.0


def test_truncated_importance_weights_are_the_capped_ratio_of_old_to_behaviour() -> None:
    old = torch.log(torch.tensor([[0.5, 0.8, 0.3]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.2, 0.6]]))  # the engine's, some versions old
    weights = grpo.truncated_is_weights(old, behaviour, cap=2.0)
    assert weights[0].tolist() == pytest.approx([1.0, 2.0, 0.5])  # 0.8 / 0.2 = 4 -> capped at 2
    with pytest.raises(ValueError, match=r"cap=0\.5 must be >= 1"):
        grpo.truncated_is_weights(old, behaviour, cap=0.5)


def test_importance_weights_scale_each_tokens_policy_loss_and_none_leaves_it_unchanged() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_()
    mask = torch.ones(1, 2)
    plain = grpo.grpo_loss(logp, logp.detach(), torch.tensor([1.0]), mask, clip_eps=0.2,
                           normalizer=2)
    same = grpo.grpo_loss(logp, logp.detach(), torch.tensor([1.0]), mask, clip_eps=0.2,
                          normalizer=2, is_weights=None)
    weighted = grpo.grpo_loss(logp, logp.detach(), torch.tensor([1.0]), mask, clip_eps=0.2,
                              normalizer=2, is_weights=torch.tensor([[2.0, 0.5]]))
    assert float(plain.loss) == float(same.loss) == pytest.approx(-1.0)
    assert float(weighted.loss) == pytest.approx((-2.0 - 0.5) / 2)
    (grad,) = torch.autograd.grad(weighted.loss, logp)
    assert grad[0].tolist() == pytest.approx([-1.0, -0.25])  # the weight carries no gradient
