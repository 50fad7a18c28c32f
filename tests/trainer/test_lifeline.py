"""A trainer outlives neither its torchrun agent nor a torchrun that died before it started.

Real processes: the test is the daemon, a `python -c` plays torchrun, and its
child plays the trainer, which calls die_with_parent() when the test opens a
gate file, so the test controls whether torchrun dies before or after it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from trainer.lifeline import LAUNCHER_PID_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux-only")

TRAINER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    gate, pid_file = Path(sys.argv[1]), Path(sys.argv[2])
    pid_file.write_text(str(os.getpid()))
    while not gate.exists():
        time.sleep(0.01)
    from trainer.lifeline import die_with_parent
    die_with_parent()
    Path(str(pid_file) + ".armed").write_text("")
    time.sleep(60)
""")

TORCHRUN = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
    time.sleep(60)
""")


def wait_for(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout  # covers two interpreter start-ups on a busy CI box
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def start(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, Path]:
    gate, pid_file = tmp_path / "gate", tmp_path / "trainer.pid"
    env = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid())}
    torchrun = subprocess.Popen([sys.executable, "-c", TORCHRUN, TRAINER, str(gate), str(pid_file)],
                                env=env)
    wait_for(pid_file)
    return torchrun, gate, pid_file


def gone_within(pid: int, timeout: float = 10.0) -> bool:
    """The trainer is the test's grandchild: poll until it is gone (or a zombie)."""
    proc = psutil.Process(pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    proc.kill()
    return False


def test_a_trainer_whose_torchrun_died_before_it_armed_exits_at_once(tmp_path: Path) -> None:
    torchrun, gate, pid_file = start(tmp_path)
    trainer = int(pid_file.read_text())
    torchrun.kill()
    torchrun.wait(timeout=10)
    gate.write_text("")
    assert gone_within(trainer), "an orphaned trainer kept running"
    assert not Path(f"{pid_file}.armed").exists()


def test_a_trainer_dies_with_its_torchrun_once_armed(tmp_path: Path) -> None:
    torchrun, gate, pid_file = start(tmp_path)
    trainer = int(pid_file.read_text())
    gate.write_text("")
    wait_for(Path(f"{pid_file}.armed"))
    assert psutil.Process(trainer).is_running(), "a trainer with a live torchrun must run on"
    torchrun.kill()
    torchrun.wait(timeout=10)
    assert gone_within(trainer), "the trainer outlived its torchrun"
