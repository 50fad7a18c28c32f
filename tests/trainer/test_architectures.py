"""Models of real architectures built here: Qwen2 and Llama with a byte-level BPE
tokenizer trained on generated text, a chat template, bf16 safetensors; loaded
by transformers' Auto classes exactly as a downloaded model would be."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from coordinator_cli.app import app
from trainer.architectures import Arch, create_model, preset
from trainer.bpe import train_bpe


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Any attempt to reach the hub must fail loudly instead of downloading.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module", params=[a.value for a in Arch])
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model(tmp_path_factory.mktemp(request.param) / "m", preset(request.param, "tiny"))


# What each architecture's chat template makes of one user message, generation prompt on.
RENDERED = {
    "qwen2": "<|im_start|>user\n4021><|im_end|>\n<|im_start|>assistant\n",
    "llama": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n4021><|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\n",
}


def test_the_model_loads_with_auto_classes_in_bf16_with_its_chat_format(built: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((built / "config.json").read_text())
    arch = config["model_type"]
    assert config["dtype"] == "bfloat16" and config["architectures"] == [
        {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[arch]]
    assert {t.dtype for t in load_file(built / "model.safetensors").values()} == {
        torch.bfloat16}
    tok = AutoTokenizer.from_pretrained(built, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(built, local_files_only=True)
    assert model.dtype == torch.bfloat16
    # The model's vocabulary is exactly the tokenizer's: no id it cannot decode.
    assert model.config.vocab_size == len(tok) == 1024
    messages = [{"role": "user", "content": "4021>"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert tok.decode(ids) == RENDERED[arch]
    # Digits are one token each, whatever the merges; the answer ends at the end of turn.
    answer = tok("1204", add_special_tokens=False)["input_ids"]
    assert [tok.decode([t]) for t in answer] == list("1204")
    end_of_turn = {"qwen2": "<|im_end|>", "llama": "<|eot_id|>"}[arch]
    assert tok.eos_token == end_of_turn
    generation = json.loads((built / "generation_config.json").read_text())
    assert generation["eos_token_id"][0] == tok.convert_tokens_to_ids(end_of_turn)
    assert tok.decode([*answer, tok.eos_token_id], skip_special_tokens=True) == "1204"
    text = "Sara has 12 apples; naïve 日本 x=3.5\n\n#### 42"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 1024) and torch.isfinite(logits).all()


def test_tokenizer_json_encodes_as_transformers_loads_it(built: Path) -> None:
    # transformers 5 loads a qwen2 tokenizer as Qwen2Tokenizer, which rebuilds its
    # normalizer and pre-tokenizer whatever tokenizer.json says: trained with
    # another pre-tokenizer, tokenizer.json and every engine would disagree.
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(built, local_files_only=True)
    raw = Tokenizer.from_file(str(built / "tokenizer.json"))
    text = "Hello  world!! It's 12345 apples;\n\n  x=3.5 #### 42 naïve"
    assert loaded(text, add_special_tokens=False)["input_ids"] == raw.encode(
        text, add_special_tokens=False).ids


def test_same_spec_and_seed_give_the_same_bytes_and_another_seed_other_weights(
        tmp_path: Path) -> None:
    spec = preset("llama", "tiny", num_hidden_layers=1)
    a = create_model(tmp_path / "a", spec, seed=3)
    b = create_model(tmp_path / "b", spec, seed=3)
    c = create_model(tmp_path / "c", spec, seed=4)
    for p in sorted(a.iterdir()):
        assert p.read_bytes() == (b / p.name).read_bytes(), p.name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", [a.value for a in Arch])
@pytest.mark.parametrize("size", ["tiny", "small", "0.5b"])
def test_each_preset_has_the_parameters_its_spec_counts(arch: str, size: str) -> None:
    from transformers import AutoModelForCausalLM

    from trainer.architectures import _config

    spec = preset(arch, size)
    # Built on the meta device: the shape without the memory (0.5b: 494 M parameters).
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(spec, {"bos": 0, "eos": 1, "pad": 0}))
    assert sum(p.numel() for p in model.parameters()) == spec.parameters()
    if (arch, size) == ("qwen2", "0.5b"):
        assert spec.parameters() == 494_032_768  # Qwen2.5-0.5B's count


def test_shapes_and_vocabularies_that_cannot_work_are_refused_naming_the_rule() -> None:
    with pytest.raises(ValueError, match="not an even integer head size"):
        preset("qwen2", "tiny", num_attention_heads=3)
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads=3"):
        preset("llama", "tiny", num_key_value_heads=3)
    with pytest.raises(ValueError, match="size='1b' is not one of"):
        preset("qwen2", "1b")
    with pytest.raises(ValueError, match="vocab_size=200 is below 303"):
        train_bpe(200, ("<a>", "<b>", "<c>"))
    tok = train_bpe(700, ("<a>",))
    assert tok.get_vocab_size() == 700 and tok.token_to_id("<a>") == 0


def test_init_model_builds_a_sealed_real_architecture_and_refuses_bad_shapes(
        tmp_path: Path) -> None:
    from trainer.checkpoint import verify_checkpoint

    runner = CliRunner()
    out = tmp_path / "qwen"
    done = runner.invoke(app, ["init-model", "--out", str(out), "--arch", "qwen2", "--size",
                               "tiny", "--layers", "1", "--vocab", "512",
                               "--warmstart-steps", "0"])
    assert done.exit_code == 0, done.output
    assert "qwen2 model (" in done.output and "bfloat16) written to" in done.output
    assert verify_checkpoint(out).iteration == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["vocab_size"]) == (1, 512)
    refused = runner.invoke(app, ["init-model", "--out", str(tmp_path / "x"), "--arch", "qwen2",
                                  "--heads", "3"])
    assert refused.exit_code == 2 and "not an even integer head size" in refused.output
    refused = runner.invoke(app, ["init-model", "--out", str(tmp_path / "y"), "--hidden", "64"])
    assert refused.exit_code == 2 and "--arch char has its fixed shape" in refused.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
