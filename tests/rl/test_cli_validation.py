"""Every bad value exits 2 with a message naming the value and the fix."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from rl.cli import app

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
    code, out = invoke("run", "--master", "--log-path", str(tmp_path), *args)
    assert code == 2, out
    assert message in out


def test_worker_rank_out_of_range_exits_2(tmp_path) -> None:
    code, out = invoke("run", "--worker", "3", "--num-nodes", "3", "--log-path", str(tmp_path))
    assert code == 2 and "--worker 3 is out of range for --num-nodes 3" in out
    code, out = invoke("run", "--worker", "-1", "--log-path", str(tmp_path))
    assert code == 2 and "--worker -1 is below 1" in out


def test_master_and_worker_together_exit_2(tmp_path) -> None:
    code, out = invoke("run", "--master", "--worker", "1", "--log-path", str(tmp_path))
    assert code == 2 and "--master and --worker 1 both given" in out


def test_no_log_path_exits_2() -> None:
    code, out = invoke("run", "--master")
    assert code == 2 and "--log-path is required" in out


def test_a_log_path_that_is_a_file_exits_2(tmp_path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    code, out = invoke("run", "--master", "--log-path", str(f))
    assert code == 2 and f"--log-path {f} is a file, not a directory" in out


def test_a_log_path_that_is_not_writable_exits_2(tmp_path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:  # root writes through permissions: use a read-only mount
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    else:
        ro.chmod(0o555)
    try:
        code, out = invoke("run", "--master", "--log-path", str(ro))
        assert code == 2 and "is not writable" in out
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], check=True)


def test_no_rank_at_all_exits_2_and_env_ranks_are_honoured(tmp_path, monkeypatch) -> None:
    for var in ("RANK", "NODE_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    code, out = invoke("run", "--log-path", str(tmp_path))
    assert code == 2 and "no rank given: pass --master" in out
    monkeypatch.setenv("SLURM_PROCID", "4")
    code, out = invoke("run", "--num-nodes", "2", "--log-path", str(tmp_path))
    assert code == 2 and "--worker 4 is out of range for --num-nodes 2" in out


def test_unknown_config_keys_exit_2_listing_the_known_ones(tmp_path) -> None:
    code, out = invoke("run", "--master", "--log-path", str(tmp_path), "--actions", "scripted",
                       "--set", "coordination.leese_s=3")
    assert code == 2 and "unknown key coordination.leese_s" in out and "lease_s" in out
    code, out = invoke("run", "--master", "--log-path", str(tmp_path), "--actions", "scripted",
                       "--lease", "1", "--heartbeat-interval", "2")
    assert code == 2 and "must be below coordination.lease_s=1.0" in out


def test_a_worker_beyond_the_masters_node_count_exits_2(tmp_path) -> None:
    master = subprocess.Popen(
        [sys.executable, "-m", "rl", "run", "--master", "--num-nodes", "2",
         "--actions", "scripted", "--log-path", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "rl", "run", "--worker", "5", "--log-path",
             str(tmp_path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2
        assert "--worker 5 is out of range: run" in out.stderr and "workers are 1..1" in out.stderr
    finally:
        master.kill()
        master.wait()


def test_recover_rejects_a_negative_or_unreached_iteration(tmp_path) -> None:
    code, out = invoke("recover", "--log-path", str(tmp_path), "--iteration", "-1")
    assert code == 2 and "--iteration -1 is outside 0..999999" in out
    subprocess.run(
        [sys.executable, "-m", "rl", "run", "--master", "--num-nodes", "1",
         "--actions", "scripted", "--iterations", "2", "--log-path", str(tmp_path)],
        check=True, capture_output=True, timeout=60)
    code, out = invoke("recover", "--log-path", str(tmp_path), "--iteration", "7")
    assert code == 2 and "--iteration 7 was never reached" in out
    assert "between 0 and 2" in out


def test_recover_without_a_run_exits_2(tmp_path) -> None:
    code, out = invoke("recover", "--log-path", str(tmp_path), "--iteration", "0")
    assert code == 2 and "holds no run" in out


def test_a_yaml_config_works_like_toml(tmp_path) -> None:
    from coordinator.actions import resolve_config
    from coordinator.config import load_file

    (tmp_path / "c.yaml").write_text(
        "run:\n  actions: scripted\n  iterations: 3\ncoordination:\n  lease_s: 9\n")
    (tmp_path / "c.toml").write_text(
        '[run]\nactions = "scripted"\niterations = 3\n[coordination]\nlease_s = 9\n')
    yaml_config = resolve_config(load_file(tmp_path / "c.yaml"))
    assert yaml_config == resolve_config(load_file(tmp_path / "c.toml"))
    assert yaml_config.coordination.lease_s == 9.0
    (tmp_path / "c.ini").write_text("x")
    code, out = invoke("run", "--master", "--log-path", str(tmp_path / "run"), "--config",
                       str(tmp_path / "c.ini"))
    assert code == 2 and "use .toml, .yaml or .yml" in out
