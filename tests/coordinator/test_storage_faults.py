"""A full or read-only shared filesystem in the middle of a run.

The run directory sits on a small tmpfs.  Three daemons run; the test fills
the tmpfs (ENOSPC) or remounts it read-only (EROFS).  Every daemon must stop
with exit code 8 (STORAGE) and a message naming the path it could not write
and the errno; every record left on disk must still parse (publish by
rename never tears a file); and after space is freed (or the mount is made
writable again), `coordinator recover` and a restart of every node complete
the run.  Both faults need root to mount; without it the test fails, saying
why: it never skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import LocalCluster, write_config

pytestmark = pytest.mark.slow
LEASE = 3.0


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "fs"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs for the ENOSPC/EROFS tests needs root; run the suite as "
                    "root (CI does)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs",
                           str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"could not mount a tmpfs at {mount}: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill(mount: Path) -> Path:
    """Write zeros until the filesystem is full; the filler file."""
    filler = mount / "filler"
    with open(filler, "wb") as f:
        block = b"\0" * 65536
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError:
            pass
    return filler


def _remount(mount: Path, mode: str) -> None:
    """remount,ro can meet EBUSY while a daemon has a file open for writing: retry."""
    deadline = time.monotonic() + 10
    while True:
        done = subprocess.run(["mount", "-o", f"remount,{mode}", str(mount)],
                              capture_output=True, text=True)
        if done.returncode == 0:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"could not remount {mount} {mode}: {done.stderr.strip()}")
        time.sleep(0.01)


def _all_json_parses(run: Path) -> list[str]:
    bad = []
    for path in run.rglob("*.json"):
        if path.name.startswith("."):
            continue
        try:
            json.loads(path.read_text())
        except ValueError as exc:
            bad.append(f"{path}: {exc}")
    return bad


def _recover_and_finish(c: LocalCluster) -> None:
    hbs = [c.heartbeat(r) for r in range(3)]
    iteration = min(hb["iteration"] for hb in hbs if hb is not None)
    out = subprocess.run([sys.executable, "-m", "coordinator_cli", "recover", "--run-dir",
                          str(c.run_dir), "--iteration", str(iteration)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    c.start_all()
    codes = c.wait_all(timeout=120)
    assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-2000:] for r in codes}


@pytest.mark.parametrize("fault", ["ENOSPC", "EROFS"])
def test_every_daemon_exits_8_naming_the_path_and_recover_completes_the_run(
    tmp_path: Path, tmpfs: Path, fault: str
) -> None:
    config = write_config(tmp_path / "c.toml", iterations=4, lease=LEASE,
                          scripted='sleep_s = 0.1')
    # The three daemons share one node's directory of the run (rl/node_local.py).
    node_tmp = tmp_path / "node-tmp"
    node_tmp.mkdir()
    c = LocalCluster(tmpfs / "run", tmp_path, num_nodes=3, config=config,
                     env={"TMPDIR": str(node_tmp)})
    filler = None
    try:
        c.start_all()
        c.wait_until(lambda: c.at_phase(0, 1, 3), 60, "the master in iteration 1")
        if fault == "ENOSPC":
            filler = _fill(tmpfs)
        else:
            _remount(tmpfs, "ro")
        hit = time.monotonic()
        for rank in range(3):
            code = c.wait(rank, timeout=LEASE + 20)
            out = c.output(rank)
            assert code == 8, out[-2000:]
            assert time.monotonic() - hit < LEASE + 10
            words = "No space left on device (ENOSPC)" if fault == "ENOSPC" else \
                "Read-only file system (EROFS)"
            assert f"cannot write {c.run_dir}/" in out and words in out, out[-2000:]
            # Leaving at once, none met the directory half-removed by another (finding
            # 13: FileNotFoundError on .locks/cache.lock), and each one's own log stopped
            # with one line naming the error.
            assert "Traceback" not in out, out[-3000:]
            assert out.count("could not write this daemon's log") <= 1, out[-3000:]
            assert f"rank {rank} joined run" in (c.run_dir / f"ranks/{rank}/logs/daemon.log"
                                                 ).read_text()
        assert list(node_tmp.iterdir()) == []  # the last to leave removed it, then the base
        assert _all_json_parses(c.run_dir) == []
        if filler is not None:
            filler.unlink()
        else:
            _remount(tmpfs, "rw")
        _recover_and_finish(c)
    finally:
        c.close()
