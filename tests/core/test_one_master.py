"""Two masters started at the same instant on a fresh run directory: exactly one runs.

run.json of a new run is created with link(2), like a rank claim, and a live
claim is never taken over; so of two masters racing, one creates the run (or
finds it) and holds rank 0, and the other exits 2 naming the holder.  The
race is forced: both processes import everything, then block on a gate
that the test opens for both at once; it is run 20 times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.core.cluster import write_config

pytestmark = pytest.mark.slow
TRIALS = 12

# Imports done, then wait for the gate byte on stdin, then run the CLI.
GATED = (
    "import os, sys\n"
    "from rl.cli import main\n"
    "import coordinator.daemon, coordinator.runplan, coordinator.scripted\n"
    "os.read(0, 1)\n"
    "sys.argv = ['coordinator'] + sys.argv[1:]\n"
    "main()\n"
)


def _master(log_path: Path, config: Path, out: Path) -> subprocess.Popen[bytes]:
    with open(out, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-c", GATED, "run", "--master", "--num-nodes", "2",
             "--config", str(config), "--log-path", str(log_path)],
            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT)


def _claim_pid(log_path: Path) -> int | None:
    try:
        return int(json.loads((log_path / "ranks/0/claim.json").read_text())["pid"])
    except (FileNotFoundError, ValueError, KeyError):
        return None


def test_of_two_masters_started_at_once_exactly_one_runs_every_time(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", iterations=1)
    for trial in range(TRIALS):
        log_path = tmp_path / f"run{trial}"
        procs = [_master(log_path, config, tmp_path / f"t{trial}-m{i}.log") for i in (0, 1)]
        try:
            time.sleep(0.2)
            for p in procs:  # open the gate for both, back to back
                assert p.stdin is not None
                os.write(p.stdin.fileno(), b"g")
            deadline = time.monotonic() + 60
            while all(p.poll() is None for p in procs):
                assert time.monotonic() < deadline, f"trial {trial}: neither master gave way"
                time.sleep(0.05)
            loser = next(p for p in procs if p.poll() is not None)
            winner = next(p for p in procs if p is not loser)
            text = (tmp_path / f"t{trial}-m{procs.index(loser)}.log").read_text()
            assert loser.returncode == 2, f"trial {trial}: {text}"
            assert f"already held by pid {winner.pid}" in text, f"trial {trial}: {text}"
            # The winner runs on: it holds rank 0 and waits for rank 1.
            time.sleep(0.5)
            assert winner.poll() is None, f"trial {trial}: the winner stopped too"
            assert _claim_pid(log_path) == winner.pid
            manifest = json.loads((log_path / "run.json").read_text())
            assert manifest["generation"] == 0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=30)
