"""A run directory on an object-store FUSE mount is refused by `coordinator run` itself,
on every node, within seconds: exit 9 naming the mount, what it lacks and the fix; no
traceback, no worker waiting for a master that refused (issue 25, point 1)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from coordinator.errors import ExitCode, UnsuitableStorageError
from coordinator.storage.storage_check import check_run_directory
from tests.integration.usage import README_PATH, run_nodes, usage_line
from tests.support.rclone import RcloneMount

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a FUSE mount needs root")


def test_the_usage_line_on_an_rclone_mount_is_refused_on_every_node(tmp_path: Path) -> None:
    with RcloneMount(tmp_path) as mount:
        run_dir = mount.point / "rl-try"
        commands = [[arg.replace(README_PATH, str(run_dir)) for arg in command]
                    for command in usage_line()]
        started = time.monotonic()
        run = run_nodes(commands, cwd=tmp_path, timeout_s=120)
        took = time.monotonic() - started
        listed = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []
    assert run.codes == {0: ExitCode.UNSUITABLE_STORAGE, 1: ExitCode.UNSUITABLE_STORAGE,
                         2: ExitCode.UNSUITABLE_STORAGE}, run.logs
    assert took < 60, f"the nodes needed {took:.1f} s to refuse"
    for log in run.logs.values():
        assert "Traceback" not in log, log
        assert "fuse.rclone" in log and "rename copies then deletes" in log, log
        assert "NFS, Lustre" in log, log  # the fix
    # Nothing of the protocol was written: no run.json, no claim, no probe left.
    assert listed == [], listed
    print(f"\nrefused on 3 nodes in {took:.1f} s:\n{run.logs[1]}")


def test_a_directory_without_hard_links_is_refused_naming_link(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def no_link(src: object, dst: object, **kwargs: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "link", no_link)
    with pytest.raises(UnsuitableStorageError,
                       match=r"link\(2\) fails \(Input/output error, errno 5\)") as caught:
        check_run_directory(tmp_path)
    assert caught.value.exit_code == ExitCode.UNSUITABLE_STORAGE
    assert list(tmp_path.iterdir()) == []  # the probe's files are gone
    monkeypatch.undo()
    check_run_directory(tmp_path)  # a local filesystem with hard links passes
