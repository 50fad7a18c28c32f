"""Every bad value exits 2 with a message naming the value and the fix."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from coordinator.errors import UsageError
from coordinator_cli.app import app
from rl.config import SECTION_CLASSES

runner = CliRunner()


def invoke(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    text = result.output
    with contextlib.suppress(ValueError):
        text += result.stderr
    return result.exit_code, text


@pytest.mark.parametrize(("args", "message"), [
    (["--num-nodes", "3", "--rank-weights", "1,1"],
     "--rank-weights has 2 values but --num-nodes is 3: give one weight per node, e.g. 1,1,1"),
    (["--num-nodes", "3", "--rank-weights", "1,-1,1"], "the weight of rank 1, -1.0, is negative"),
    (["--num-nodes", "2", "--rank-weights", "0,0"], "sum to zero: at least one node must get work"),
    (["--num-nodes", "2", "--rank-weights", "1,x"], "'x' is not a number"),
    (["--num-nodes", "0"], "--num-nodes 0 is below 1"),
])
def test_bad_master_values_exit_2_naming_value_and_fix(tmp_path, args, message) -> None:
    code, out = invoke("run", "--master", "--run-dir", str(tmp_path), *args)
    assert code == 2, out
    assert message in out


def test_worker_rank_out_of_range_exits_2(tmp_path) -> None:
    code, out = invoke("run", "--worker", "3", "--num-nodes", "3", "--run-dir", str(tmp_path))
    assert code == 2 and "--worker 3 is out of range for --num-nodes 3" in out
    code, out = invoke("run", "--worker", "-1", "--run-dir", str(tmp_path))
    assert code == 2 and "--worker -1 is below 1" in out


def test_master_and_worker_together_exit_2(tmp_path) -> None:
    code, out = invoke("run", "--master", "--worker", "1", "--run-dir", str(tmp_path))
    assert code == 2 and "--master and --worker 1 both given" in out


def test_no_run_dir_exits_2() -> None:
    code, out = invoke("run", "--master")
    assert code == 2 and "--run-dir is required" in out


@pytest.mark.parametrize("command", ["run", "status", "recover", "timeline", "doctor", "export"])
def test_every_command_takes_the_run_dir_also_as_the_flag_file_scripts_log_path(
        tmp_path, command) -> None:
    """One declaration for every command: --run-dir, and --log-path (the name the
    flag-file run.sh used) is the same option."""
    missing = tmp_path / "absent"
    for flag in ("--run-dir", "--log-path"):
        extra = ["--out", str(tmp_path / "out")] if command == "export" else []
        code, out = invoke(command, flag, "" if command in ("run", "doctor") else str(missing),
                           *extra)
        assert code == 2, out
        assert "--run-dir" in out and "No such option" not in out, out


def test_a_log_path_that_is_a_file_exits_2(tmp_path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    code, out = invoke("run", "--master", "--run-dir", str(f))
    assert code == 2 and f"--run-dir {f} is a file, not a directory" in out


def test_a_log_path_that_is_not_writable_exits_2(tmp_path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:  # root writes through permissions: use a read-only mount
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    else:
        ro.chmod(0o555)
    try:
        code, out = invoke("run", "--master", "--run-dir", str(ro))
        assert code == 2 and "is not writable" in out
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], check=True)


def test_no_rank_at_all_exits_2_and_env_ranks_are_honoured(tmp_path, monkeypatch) -> None:
    for var in ("RANK", "NODE_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    code, out = invoke("run", "--run-dir", str(tmp_path))
    assert code == 2 and "no rank given: pass --master" in out
    monkeypatch.setenv("SLURM_PROCID", "4")
    code, out = invoke("run", "--num-nodes", "2", "--run-dir", str(tmp_path))
    assert code == 2 and "--worker 4 is out of range for --num-nodes 2" in out


def test_unknown_config_keys_exit_2_naming_the_closest_setting(tmp_path) -> None:
    code, out = invoke("run", "--master", "--run-dir", str(tmp_path), "--actions", "scripted",
                       "--set", "coordination.leese_s=3")
    assert code == 2 and \
        "coordination.leese_s: no such setting; did you mean coordination.lease_s?" in out
    code, out = invoke("run", "--master", "--run-dir", str(tmp_path), "--actions", "scripted",
                       "--lease", "1", "--heartbeat-interval", "2")
    assert code == 2 and "must be below coordination.lease_s=1.0" in out


def test_a_worker_beyond_the_masters_node_count_exits_2(tmp_path) -> None:
    master = subprocess.Popen(
        [sys.executable, "-m", "coordinator_cli", "run", "--master", "--num-nodes", "2",
         "--actions", "scripted", "--run-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "coordinator_cli", "run", "--worker", "5", "--run-dir",
             str(tmp_path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2
        assert "--worker 5 is out of range: run" in out.stderr and "workers are 1..1" in out.stderr
    finally:
        master.kill()
        master.wait()


def test_recover_rejects_a_negative_iteration_a_complete_run_and_any_but_the_resume_point(
        tmp_path) -> None:
    code, out = invoke("recover", "--run-dir", str(tmp_path), "--iteration", "-1")
    assert code == 2 and "--iteration -1 is outside 0..999999" in out
    subprocess.run(
        [sys.executable, "-m", "coordinator_cli", "run", "--master", "--num-nodes", "1",
         "--actions", "scripted", "--iterations", "2", "--run-dir", str(tmp_path)],
        check=True, capture_output=True, timeout=60)
    # Complete: nothing to recover, whichever iteration is named (it used to bump the
    # generation for an iteration 2 the 2-iteration run never had).
    for iteration in ("7", "2", "1"):
        code, out = invoke("recover", "--run-dir", str(tmp_path), "--iteration", iteration)
        assert code == 2 and "is complete (every journal completed its 2 iterations)" in out
    # Rank 0's journal back at iteration 1: a restart resumes there, so only 1 is recovered.
    from coordinator.records import layout
    from coordinator.records.records import Journal, Manifest
    from coordinator.storage.store import FsStore, publish_record, read_record

    store = FsStore(tmp_path)
    run_id = read_record(store, layout.MANIFEST, Manifest, retry_s=0).run_id  # type: ignore[union-attr]
    publish_record(store, layout.journal(0), Journal(run_id=run_id, rank=0,
                                                     completed_iteration=0, iteration=1, done=()))
    for iteration in ("0", "7"):
        code, out = invoke("recover", "--run-dir", str(tmp_path), "--iteration", iteration)
        assert code == 2, out
        assert f"--iteration {iteration} is not where run {run_id} resumes: the lowest " \
            "iteration a journal has not completed: rank(s) [0] stopped in iteration 1, and a " \
            "restart resumes there; give --iteration 1, or leave it out" in " ".join(out.split())
    code, out = invoke("recover", "--run-dir", str(tmp_path), "--iteration", "1", "--dry-run")
    assert code == 0 and "at iteration 1" in out, out


def test_recover_without_a_run_exits_2(tmp_path) -> None:
    code, out = invoke("recover", "--run-dir", str(tmp_path), "--iteration", "0")
    assert code == 2 and "holds no run" in out


def test_a_yaml_config_works_like_toml(tmp_path) -> None:
    from coordinator.config.run_config import load_file
    from coordinator.machine.actions import resolve_config

    (tmp_path / "c.yaml").write_text(
        "run:\n  actions: scripted\n  iterations: 3\ncoordination:\n  lease_s: 9\n")
    (tmp_path / "c.toml").write_text(
        '[run]\nactions = "scripted"\niterations = 3\n[coordination]\nlease_s = 9\n')
    yaml_config = resolve_config(load_file(tmp_path / "c.yaml"))
    assert yaml_config == resolve_config(load_file(tmp_path / "c.toml"))
    assert yaml_config.coordination.lease_s == 9.0
    (tmp_path / "c.ini").write_text("x")
    code, out = invoke("run", "--master", "--run-dir", str(tmp_path / "run"), "--config",
                       str(tmp_path / "c.ini"))
    assert code == 2 and "use .toml, .yaml or .yml" in out


def mistyped(name: str) -> str:
    """`name` with its last letter doubled: a typo closest to `name` of all settings."""
    return name + name[-1]


@pytest.mark.parametrize("section", list(SECTION_CLASSES))
def test_every_section_refuses_a_mistyped_key_naming_the_closest_setting(section) -> None:
    from coordinator.machine.actions import resolve_config

    for f in dataclasses.fields(SECTION_CLASSES[section]):
        with pytest.raises(UsageError, match=re.escape(
                f"{section}.{mistyped(f.name)}: no such setting; did you mean "
                f"{section}.{f.name}?")):
            resolve_config({section: {mistyped(f.name): 1}})


@pytest.mark.parametrize(("raw", "message"), [
    # A verl name far from ours, a key of another section, a key without its section.
    ({"train": {"learning_rate": 1e-5}}, "train.learning_rate: no such setting; did you mean "
                                         "train.lr?"),
    ({"train": {"max_tokens": 64}}, "train.max_tokens: no such setting; did you mean "
                                    "rollout.max_tokens?"),
    ({"lr": 1e-5}, "lr: no such setting; did you mean train.lr?"),
    ({"trian": {"lr": 1e-5}}, "[trian]: no such section; did you mean [train]?"),
    ({"coordination": {"phase_timeouts_s": {"trian": 9}}},
     "coordination.phase_timeouts_s.trian: no such setting; did you mean "
     "coordination.phase_timeouts_s.train?"),
    ({"train": {"zzz": 1}}, "train.zzz: no such setting; the settings of [train] are "
                            "activation_checkpointing, adam_eps"),
])
def test_a_key_far_from_any_setting_still_names_where_to_look(raw, message) -> None:
    from coordinator.machine.actions import resolve_config

    with pytest.raises(UsageError, match=re.escape(message)):
        resolve_config(raw)


def test_the_trainer_refuses_an_unknown_key_too() -> None:
    from trainer.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=re.escape("train.lrr: no such setting; did you mean "
                                                    "train.lr?")):
        TrainConfig.from_dict({"lrr": 1e-5})


def test_a_train_typo_exits_2_at_start_from_set_and_from_a_config_file(tmp_path) -> None:
    message = "train.lrr: no such setting; did you mean train.lr?"
    run = tmp_path / "run"
    code, out = invoke("run", "--master", "--run-dir", str(run), "--set", "train.lrr=1e-5")
    assert code == 2 and message in out, out
    config = tmp_path / "c.toml"
    config.write_text("[train]\nlrr = 1e-5\n")
    code, out = invoke("run", "--master", "--run-dir", str(run), "--config", str(config))
    assert code == 2 and message in out, out
    assert not (run / "run.json").exists()  # refused before anything was written


def test_a_worker_refuses_its_own_typo_without_waiting_for_the_master(tmp_path) -> None:
    # No master ever comes: before, the worker waited for one (here 20 s, then exit 5).
    started = time.monotonic()
    code, out = invoke("run", "--worker", "1", "--run-dir", str(tmp_path), "--set",
                       "coordination.join_timeout_s=20", "--set", "rollout.grup_size=4")
    assert code == 2 and "rollout.grup_size: no such setting; did you mean " \
        "rollout.group_size?" in out, out
    assert time.monotonic() - started < 15


def test_a_missing_config_file_exits_2_and_a_symlinked_one_is_read(tmp_path) -> None:
    from coordinator.config.run_config import load_file

    code, out = invoke("run", "--master", "--run-dir", str(tmp_path / "run"), "--config",
                       str(tmp_path / "nope.toml"))
    assert code == 2 and f"--config {tmp_path / 'nope.toml'} does not exist" in out
    (tmp_path / "real.toml").write_text("[train]\nlr = 1e-5\n")
    (tmp_path / "link.toml").symlink_to(tmp_path / "real.toml")
    assert load_file(tmp_path / "link.toml") == {"train": {"lr": 1e-5}}
