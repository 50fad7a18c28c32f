"""A bf16 model stays bf16: the trainer keeps fp32 master weights (in memory and in
the training state) and publishes every checkpoint in the model's own dtype, with
probes scored on exactly the weights it publishes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.test_train_state import SINGLE, job_for, write_batches
from trainer import train_state
from trainer.architectures import create_model, preset
from trainer.checkpoint import read_manifest, saved_dtype
from trainer.policy import param_digest
from trainer.probes import compare, make_probe_set
from trainer.session import open_session
from trainer.train import train_iteration


def probes_of(model: Any, vocab_size: int) -> list[list[float]]:
    config = model.config
    specials = [config.bos_token_id, config.eos_token_id, config.pad_token_id]
    found = make_probe_set(lambda ids: model(input_ids=ids).logits, vocab_size=vocab_size,
                           special_ids=specials, dtype="float32")
    return [list(s.logprobs) for s in found.sequences]


def test_a_bf16_model_is_published_in_bf16_with_probes_of_those_weights_and_fp32_state(
        tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir = create_model(tmp_path / "model", preset("qwen2", "tiny", num_hidden_layers=1))
    write_batches(tmp_path, model_dir, iterations=1)
    job = job_for(tmp_path, 1, model_dir, save_state=True, lr=1e-3, warmup_steps=0)
    session = open_session(job, SINGLE)
    assert session.publish_dtype == "bfloat16" == saved_dtype(model_dir)
    metrics = train_iteration(session, job)

    # The checkpoint: bf16 weights, the model's own config (bf16) carried over.
    weights = load_file(job.out_dir / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert json.loads((job.out_dir / "config.json").read_text())["dtype"] == "bfloat16"
    # The trainer still holds fp32 masters, not rounded by publishing (restored
    # after the probes), and they are what the training state keeps.
    masters = dict(session.model.named_parameters())
    assert param_digest(session.model) == metrics["params_sha256"]
    assert all(p.dtype == torch.float32 for p in masters.values())
    embed = masters["model.embed_tokens.weight"].detach()
    assert not torch.equal(embed, embed.to(torch.bfloat16).float())
    (index,) = train_state.complete_state(train_state.state_dir(job.state_dir, 1))
    state = train_state.load_shard(train_state.state_dir(job.state_dir, 1), index).weights
    assert torch.equal(state["model.embed_tokens.weight"], embed)
    assert torch.equal(weights["model.embed_tokens.weight"], embed.to(torch.bfloat16))

    # The manifest's probes are what the published weights give (an engine loading
    # them in float32 agrees within rounding of the kernels), not the masters'.
    expected = read_manifest(job.out_dir).probes
    assert expected is not None and expected.dtype == "float32"
    published = AutoModelForCausalLM.from_pretrained(job.out_dir, dtype=torch.float32).eval()
    served = probes_of(published, published.config.vocab_size)
    assert compare(expected, served, 1.0).mean_abs_diff < 1e-5
    with torch.no_grad():
        for name, p in published.named_parameters():
            p.copy_(masters[name])
    unrounded = compare(expected, probes_of(published, published.config.vocab_size), 1.0)
    # Probes of the masters would differ by the rounding: enough to fail an honest check.
    assert unrounded.mean_abs_diff > 1e-4, unrounded


@pytest.mark.parametrize("dtype", ["float16", None])
def test_the_published_dtype_is_the_configs_and_float32_when_it_names_none(
        tmp_path: Path, dtype: str | None) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": dtype}))
    assert saved_dtype(tmp_path) == (dtype or "float32")
