"""docs/CONFIG.md is generated from the settings' declarations, and every setting has help."""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from coordinator.config.settings import Section, iter_settings
from coordinator.errors import UsageError
from coordinator.machine.actions import resolve_config
from coordinator_cli import config_doc
from coordinator_cli.app import app
from coordinator_cli.flags import ALL_SECTIONS
from rl.verl_keys import VERL_KEYS


def test_docs_config_md_is_what_the_declarations_generate() -> None:
    assert config_doc.DOC.read_text() == config_doc.render(), (
        "docs/CONFIG.md is stale: run python -m coordinator_cli.config_doc > docs/CONFIG.md")


def test_every_setting_has_one_sentence_of_help_and_a_row_in_the_doc() -> None:
    text = config_doc.DOC.read_text()
    for name, cls in ALL_SECTIONS.items():
        for key, declared, _, _ in iter_settings(cls, name):
            assert declared.help.endswith((".", ")")) and len(declared.help) < 500, key
            assert f"| `{key}` |" in text, key


def test_a_setting_without_a_declaration_cannot_be_documented() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Bare(Section):
        SECTION: ClassVar[str] = "bare"
        x: int = 1

    with pytest.raises(TypeError, match=r"Bare\.x has no declaration"):
        config_doc.render({"bare": Bare})


def test_the_verl_table_names_only_settings_and_flags_that_exist() -> None:
    ours = {key for name, cls in ALL_SECTIONS.items() for key, *_ in iter_settings(cls, name)}
    run_help = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"}).output
    assert len({k.verl for k in VERL_KEYS}) == len(VERL_KEYS)
    for k in VERL_KEYS:
        if k.ours.startswith("--"):
            assert f" {k.ours} " in run_help, k
        elif k.ours:
            assert k.ours in ours, k
        else:
            assert k.note, f"{k.verl}: say what we do instead"
    for verl, here in (("actor_rollout_ref.rollout.n", "rollout.group_size"),
                       ("data.train_batch_size", "rollout.tasks_per_iteration"),
                       ("actor_rollout_ref.actor.ppo_mini_batch_size", "train.mini_batch_size"),
                       ("actor_rollout_ref.actor.optim.lr", "train.lr"),
                       ("trainer.save_freq", "train.save_interval")):
        assert any(k.verl == verl and k.ours == here for k in VERL_KEYS), verl


@pytest.mark.parametrize(("raw", "meant"), [
    ({"rollout": {"n": 8}}, "rollout.n: no such setting; did you mean rollout.group_size?"),
    ({"train": {"ppo_mini_batch_size": 8}},
     "train.ppo_mini_batch_size: no such setting; did you mean train.mini_batch_size?"),
    ({"trainer": {"save_freq": 5}},
     "trainer.save_freq: no such setting; did you mean train.save_interval?"),
    ({"train": {"learning_rate": 1e-5}},
     "train.learning_rate: no such setting; did you mean train.lr?"),
    ({"actor_rollout_ref": {"rollout": {"n": 8}, "actor": {"optim": {"lr": 1e-6}}}},
     "actor_rollout_ref.actor.optim.lr: no such setting; did you mean train.lr?"),
    ({"custom_reward_function": {"path": "r.py"}},
     "custom_reward_function.path: no such setting; did you mean reward.path?"),
])
def test_a_verl_name_is_answered_from_the_same_table(raw, meant) -> None:
    with pytest.raises(UsageError, match=re.escape(meant)):
        resolve_config(raw)


def test_a_verl_override_on_the_command_line_exits_2_naming_our_key(tmp_path) -> None:
    result = CliRunner().invoke(app, ["run", "--master", "--run-dir", str(tmp_path), "--set",
                                      "actor_rollout_ref.rollout.n=8"])
    assert result.exit_code == 2
    assert ("actor_rollout_ref.rollout.n: no such setting; did you mean rollout.group_size?"
            in result.output + result.stderr)
