"""`coordinator run`'s config flags: declared once (rl/cli_flags.py), each a real key."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from coordinator.actions import resolve_config
from rl.cli import app
from rl.cli_flags import CONFIG_FLAGS, overrides


def test_every_config_flag_sets_a_key_the_resolved_config_has() -> None:
    resolved = resolve_config({}).to_dict()
    for f in CONFIG_FLAGS:
        node = resolved
        for part in f.key.split("."):
            assert isinstance(node, dict) and part in node, f"{f.flag} sets unknown key {f.key}"
            node = node[part]


def test_flags_win_over_set_items_and_paths_become_strings() -> None:
    out = overrides(["run.iterations=3", "train.lr=0.1"],
                    {"iterations": 5, "model": Path("/m"), "seed": None})
    assert out == {"run": {"iterations": 5}, "train": {"lr": 0.1}, "model": {"path": "/m"}}


def test_run_help_lists_every_config_flag() -> None:
    result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    for f in CONFIG_FLAGS:
        assert result.output.count(f.flag + " ") + result.output.count(f.flag + "/") >= 1, f.flag
