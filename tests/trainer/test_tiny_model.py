from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch

from trainer.tiny_model import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TINY_VOCAB,
    WEIGHTS_FILE,
    TinyModelSpec,
    create_tiny_model,
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Any attempt to reach the hub must fail loudly instead of downloading.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_model_and_tokenizer_load_offline_with_auto_classes(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    assert model.config.model_type == "llama"
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(TINY_VOCAB) == len(tok)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    ids = tok("4021>")["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(TINY_VOCAB))


def test_prompt_round_trips_one_token_per_character_after_bos(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tok("4021>")["input_ids"]
    assert ids[0] == BOS_ID
    assert ids[1:] == [TINY_VOCAB.index(c) for c in "4021>"]
    assert tok.decode(ids, skip_special_tokens=True) == "4021>"
    text = "reverse 12, then stop!\nOK"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    assert tok.decode([*tok("12")["input_ids"], EOS_ID], skip_special_tokens=True) == "12"


def test_chat_template_renders_only_known_characters(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "4021>"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "user: 4021>\nassistant: "
    assert tok.unk_token_id not in tok(text)["input_ids"]


def test_same_seed_gives_identical_weight_bytes_and_other_seed_differs(tmp_path: Path) -> None:
    a = create_tiny_model(tmp_path / "a", seed=3)
    b = create_tiny_model(tmp_path / "b", seed=3)
    c = create_tiny_model(tmp_path / "c", seed=4)
    assert (a / WEIGHTS_FILE).read_bytes() == (b / WEIGHTS_FILE).read_bytes()
    assert (a / WEIGHTS_FILE).read_bytes() != (c / WEIGHTS_FILE).read_bytes()


def test_creation_does_not_disturb_the_global_torch_rng(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    create_tiny_model(tmp_path / "m", seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_files_are_not_group_or_world_writable_and_config_names_llama(model_dir: Path) -> None:
    for p in model_dir.iterdir():
        assert not p.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH), p
    assert not list(model_dir.glob(".*.tmp"))
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["torch_dtype"] == "float32"


def test_spec_rejects_a_head_count_that_does_not_divide_the_width() -> None:
    with pytest.raises(
        ValueError, match="hidden_size=100 is not divisible by num_attention_heads=3"
    ):
        TinyModelSpec(hidden_size=100, num_attention_heads=3)
