"""Figures train.json reports: the gradient norm a step reports and clips by is
taken in float32, whatever the parameters' dtype (trainer/update.py
clip_gradients); a per-token figure over no token is None (trainer/train.py
iteration_metrics)."""

from __future__ import annotations

import pytest
import torch

from trainer.update import clip_gradients


def params_with_grads(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in ((64, 33), (33,), (7, 5, 3)):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = torch.randn(shape, generator=gen).to(dtype)
        params.append(p)
    return params


def fp32_norm(params: list[torch.nn.Parameter]) -> float:
    return float(torch.linalg.vector_norm(torch.cat([p.grad.float().flatten() for p in params])))


def test_bf16_gradients_report_their_float32_norm_where_torch_would_round_it_to_bf16() -> None:
    params = params_with_grads(torch.bfloat16)
    exact = fp32_norm(params)
    # What torch's clip_grad_norm_ reports for the same gradients: the norm in bf16.
    rounded = float(torch.nn.utils.clip_grad_norm_(params_with_grads(torch.bfloat16), 1e9))
    assert rounded != pytest.approx(exact, rel=1e-4)  # the difference this test is about
    assert clip_gradients(params, 1e9) == pytest.approx(exact, rel=1e-6)
    assert fp32_norm(params) == pytest.approx(exact, rel=1e-6)  # not clipped: below max_norm


def test_bf16_gradients_are_clipped_to_max_norm_by_their_float32_norm() -> None:
    params = params_with_grads(torch.bfloat16)
    before = fp32_norm(params)
    assert clip_gradients(params, 0.5) == pytest.approx(before, rel=1e-6)
    assert all(p.grad.dtype == torch.bfloat16 for p in params)
    assert fp32_norm(params) == pytest.approx(0.5, rel=1e-2)  # bf16's own precision


def test_float32_gradients_take_torchs_own_clip_unchanged() -> None:
    ours, torchs = params_with_grads(torch.float32), params_with_grads(torch.float32)
    expected = float(torch.nn.utils.clip_grad_norm_(torchs, 0.5))
    assert clip_gradients(ours, 0.5) == expected
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, torchs, strict=True))


def test_per_token_figures_over_no_model_token_are_none_not_zero() -> None:
    """Every response empty: clip_fraction, ratio_mean, kl and the mismatch and TIS
    figures average over no token, so nothing was measured; a batch with model
    tokens gets numbers."""
    from types import SimpleNamespace

    from trainer.config import TrainConfig
    from trainer.train import Progress, iteration_metrics
    from trainer.update import Sums

    ctx = SimpleNamespace(world_size=1, strategy=SimpleNamespace(value="single"))
    job = SimpleNamespace(iteration=3, config=TrainConfig(kl_coef=0.1), off_policy=True)

    def metrics(counts: list[int], totals: Sums) -> dict:
        batch = SimpleNamespace(model_token_counts=counts, num_samples=len(counts),
                                rewards=torch.ones(len(counts)))
        inputs = SimpleNamespace(batch=batch, advantages=torch.zeros(len(counts)))
        progress = Progress(totals=totals, losses=[0.0], grad_norms=[0.0])
        return iteration_metrics(job, ctx, inputs, progress,  # type: ignore[arg-type]
                                 (0.0, 0.0, 0.0, 0.0), 0)

    keys = ("kl", "clip_fraction", "ratio_mean", "logprob_mismatch_mean_abs",
            "logprob_mismatch_max_abs", "tis_weight_mean", "tis_truncated_fraction")
    empty = metrics([0, 0], Sums())
    assert {k: empty[k] for k in keys} == dict.fromkeys(keys)
    some = metrics([2, 3], Sums(kl=0.5, clipped=1.0, ratio=5.0, tokens=5.0))
    assert (some["kl"], some["clip_fraction"], some["ratio_mean"]) == (0.1, 0.2, 1.0)
    assert all(some[k] == 0.0 for k in keys[3:])
