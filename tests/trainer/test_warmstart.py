"""The supervised warm-up gives the tiny model some, but not much, skill."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import publish_checkpoint, verify_checkpoint
from trainer.tiny_model import create_tiny_model
from trainer.warmstart import exact_match, warm_start


def test_exact_match_needs_the_reversed_digits_followed_by_eos() -> None:
    from transformers import PreTrainedTokenizerFast

    from trainer.tiny_model import build_tokenizer_object

    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer_object(), eos_token="<eos>")
    ids = tok("1204", add_special_tokens=False).input_ids
    assert exact_match(tok, [*ids, tok.eos_token_id], "1204") == 1.0
    assert exact_match(tok, ids, "1204") == 0.0  # never stopped
    assert exact_match(tok, [*ids[:3], tok.eos_token_id], "1204") == 0.0
    assert exact_match(tok, [], "1204") == 0.0


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # Tiny matmuls gain nothing from a second thread, and on busy cores two
    # spinning OpenMP threads per process slow everything down many-fold.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_warm_start_reaches_modest_sampled_accuracy_deterministically_and_in_place(
    tmp_path: Path,
) -> None:
    plain = create_tiny_model(tmp_path / "plain", seed=0)
    before = (plain / "model.safetensors").read_bytes()
    others = {p.name: p.read_bytes() for p in plain.iterdir() if p.name != "model.safetensors"}

    result = warm_start(plain, seed=0)
    # Some skill for RL to work with, and room for RL to double it.
    assert 0.08 <= result["accuracy"] <= 0.30, result
    assert (plain / "model.safetensors").read_bytes() != before
    assert {
        p.name: p.read_bytes() for p in plain.iterdir() if p.name != "model.safetensors"
    } == others
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]  # no temp dirs left

    # A published checkpoint stays verifiable, and the same seed gives the same bytes.
    from transformers import AutoModelForCausalLM

    source = create_tiny_model(tmp_path / "src", seed=0)
    model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True)
    published = tmp_path / "iter-000000"
    publish_checkpoint(model, None, published, iteration=0, carry_files_from=source)
    shutil.rmtree(source)
    again = warm_start(published, seed=0)
    assert again["accuracy"] == result["accuracy"]
    assert verify_checkpoint(published).iteration == 0
    assert (published / "model.safetensors").read_bytes() == (
        plain / "model.safetensors"
    ).read_bytes()


def test_zero_steps_leave_the_weights_unchanged(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model_dir = create_tiny_model(tmp_path / "m", seed=1)
    before = load_file(model_dir / "model.safetensors")
    warm_start(model_dir, steps=0, seed=0)
    after = load_file(model_dir / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(bool((before[k] == after[k]).all()) for k in before)
