"""`coordinator run`'s config flags and --set: derived from the settings' declarations."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordinator.config.settings import iter_settings
from coordinator.errors import UsageError
from coordinator.machine.actions import resolve_config
from coordinator_cli.app import app
from coordinator_cli.flags import CONFIG_FLAGS, config_flags, overrides
from rl.config import SECTION_CLASSES

# The flags users know (README, launch recipes, scripts/run.sh): each must stay.
KNOWN: dict[str, str] = {
    "--iterations": "run.iterations", "--eval-interval": "schedule.eval_interval",
    "--eval-before-train": "schedule.eval_before_train",
    "--rollout-split": "schedule.rollout_split", "--rl-phase": "schedule.rl_phase",
    "--actions": "run.actions", "--seed": "run.seed", "--lease": "coordination.lease_s",
    "--heartbeat-interval": "coordination.heartbeat_interval_s",
    "--on-failure": "coordination.on_failure",
    "--max-recoveries": "coordination.max_recoveries", "--min-nodes": "coordination.min_nodes",
    "--model": "model.path", "--data-path": "data.path", "--engine": "engine.kind",
    "--local-cache": "checkpoint.local_cache", "--keep-checkpoints": "checkpoint.keep",
}


def test_every_config_flag_comes_from_a_declaration_and_the_known_ones_stay() -> None:
    declared = {key: (d.flag, default) for name, cls in SECTION_CLASSES.items()
                for key, d, _, default in iter_settings(cls, name) if d.flag}
    assert {f.key: (f.flag, f.default) for f in CONFIG_FLAGS} == declared
    assert {f.flag: f.key for f in CONFIG_FLAGS if f.flag in KNOWN} == KNOWN
    resolved = resolve_config({}).to_dict()
    for f in CONFIG_FLAGS:
        node = resolved
        for part in f.key.split("."):
            assert isinstance(node, dict) and part in node, f"{f.flag} sets unknown key {f.key}"
            node = node[part]


def test_two_settings_cannot_declare_one_flag() -> None:
    with pytest.raises(TypeError, match="flags declared by two settings: --actions, --iterations, "
                                        "--seed"):
        config_flags({"run": SECTION_CLASSES["run"], "also": SECTION_CLASSES["run"]})


def test_flags_win_over_set_items_and_paths_become_strings() -> None:
    out = overrides(["run.iterations=3", "train.lr=0.1"],
                    {"iterations": 5, "model": Path("/m"), "seed": None})
    assert out == {"run": {"iterations": 5}, "train": {"lr": 0.1}, "model": {"path": "/m"}}


def test_set_items_are_read_as_their_declared_type() -> None:
    out = overrides(["model.path=123", "engine.extra_args=--enforce-eager,--seed=1",
                     "engine.max_model_len=none", "schedule.eval_before_train=false",
                     "coordination.phase_timeouts_s.train=5", "scripted.fail=1:*:4",
                     "nosuch.key=[1]"], {})
    assert out == {"model": {"path": "123"},
                   "engine": {"extra_args": ["--enforce-eager", "--seed=1"],
                              "max_model_len": None},
                   "schedule": {"eval_before_train": False},
                   "coordination": {"phase_timeouts_s": {"train": 5.0}},
                   "scripted": {"fail": ["1:*:4"]}, "nosuch": {"key": [1]}}
    with pytest.raises(UsageError, match=re.escape(
            "--set run.iterations=eight: run.iterations is int; give e.g. run.iterations=8")):
        overrides(["run.iterations=eight"], {})


def test_run_help_lists_every_config_flag_with_its_key_and_default() -> None:
    result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = re.sub(r"[│\s]+", " ", result.output)  # one line, as rich wraps the help column
    for f in CONFIG_FLAGS:
        shown = f.default.value if hasattr(f.default, "value") else f.default
        default = f"[default: ({shown!r})]" if isinstance(shown, str) else f"[default: ({shown})]"
        assert re.search(rf" {f.flag} .*?\({re.escape(f.key)}(; \w+)?\) {re.escape(default)}",
                         text), f.flag
