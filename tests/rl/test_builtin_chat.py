"""The built-in task goes to a chat model through its chat template: which models
count as one, and what the task's chat form is."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rl.loop import builtin_as_chat
from rollout.tasks import BuiltinReverseTasks
from trainer.architectures import create_model, preset
from trainer.tiny_model import create_tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"qwen2": create_model(root / "qwen2", preset("qwen2", "tiny", num_hidden_layers=1)),
            "llama": create_model(root / "llama", preset("llama", "tiny", num_hidden_layers=1)),
            "char": create_tiny_model(root / "char")}


def test_a_model_with_a_chat_template_gets_chat_but_the_character_model_text(
        models: dict[str, Path]) -> None:
    assert builtin_as_chat(models["qwen2"]) and builtin_as_chat(models["llama"])
    assert not builtin_as_chat(models["char"])  # a base model with a toy template


def test_a_template_is_found_where_transformers_keeps_it_and_symlinks_are_followed(
        tmp_path: Path, models: dict[str, Path]) -> None:
    config = json.loads((models["qwen2"] / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    # No template at all: text.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    assert not builtin_as_chat(bare)
    # transformers 5 saves it beside, in chat_template.jinja.
    (bare / "chat_template.jinja").write_text(template)
    assert builtin_as_chat(bare)
    # Named templates: the default one.
    named = tmp_path / "named"
    named.mkdir()
    (named / "tokenizer_config.json").write_text(json.dumps(
        {**config, "chat_template": [{"name": "tool_use", "template": "x"},
                                     {"name": "default", "template": template}]}))
    assert builtin_as_chat(named)
    # A Hugging Face cache snapshot: every file a symlink to a blob.
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "tokenizer_config.json").symlink_to(models["qwen2"] / "tokenizer_config.json")
    assert builtin_as_chat(snapshot)
    # What cannot be read (a FIFO planted in its place, garbage) is no template.
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "tokenizer_config.json")
    assert not builtin_as_chat(fifo)
    (bare / "tokenizer_config.json").write_text("{not json")
    (bare / "chat_template.jinja").unlink()
    assert not builtin_as_chat(bare)


def test_the_chat_form_of_the_task_has_the_same_ids_answers_and_text() -> None:
    text, chat = BuiltinReverseTasks(seed=3), BuiltinReverseTasks(seed=3, chat=True)
    for split in ("train", "eval"):
        for a, b in zip(text.tasks(split), chat.tasks(split), strict=True):
            assert (a.task_id, a.ground_truth) == (b.task_id, b.ground_truth)
            assert b.messages() == [{"role": "user", "content": a.prompt}]
