"""Two masters started at the same instant on a fresh run directory: exactly one runs.

run.json of a new run is created with link(2), like a rank claim, and a live
claim is never taken over; so of two masters racing, one creates the run (or
finds it) and holds rank 0, and the other exits 2 naming the holder.  The
race is forced: both processes import everything, say so, then block on a
gate that the test opens for both at once; it is run 20 times.  The next
pair imports while the current one races, and every winner is left running
until the end, when each must still hold its claim.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cluster import write_config

pytestmark = pytest.mark.slow
TRIALS = 20
READY_TIMEOUT_S = 60.0  # imports on a loaded 2-core box take well under this
RACE_TIMEOUT_S = 60.0  # the loser reads run.json and the claim: seconds at most

# Imports done, say "ready", wait for the gate byte on stdin, then run the CLI.
GATED = (
    "import os, sys\n"
    "from coordinator_cli.app import main\n"
    "import coordinator.machine.daemon, coordinator.machine.runplan, rl.scripted\n"
    "os.write(1, b'ready\\n')\n"
    "os.read(0, 1)\n"
    "sys.argv = ['coordinator'] + sys.argv[1:]\n"
    "main()\n"
)


class Master:
    def __init__(self, run_dir: Path, config: Path, out: Path) -> None:
        self.run_dir = run_dir
        self.out = out
        with open(out, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", GATED, "run", "--master", "--num-nodes", "2",
                 "--config", str(config), "--run-dir", str(run_dir)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.out.read_text()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.text().startswith("ready"):
            assert self.proc.poll() is None, f"died before the gate: {self.text()}"
            assert time.monotonic() < deadline, f"not ready in {READY_TIMEOUT_S} s"
            time.sleep(0.02)

    def open_gate(self) -> None:
        assert self.proc.stdin is not None
        os.write(self.proc.stdin.fileno(), b"g")


def _claim_pid(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / "ranks/0/claim.json").read_text())["pid"])
    except (FileNotFoundError, ValueError, KeyError):
        return None


def test_of_two_masters_started_at_once_exactly_one_runs_every_time(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", iterations=1)
    # Winners wait for rank 1 until the last trial is done: past the usual join timeout.
    config.write_text(config.read_text().replace("join_timeout_s = 60.0", "join_timeout_s = 600.0"))
    assert "join_timeout_s = 600.0" in config.read_text()

    def pair(trial: int) -> list[Master]:
        return [Master(tmp_path / f"run{trial}", config, tmp_path / f"t{trial}-m{i}.log")
                for i in (0, 1)]

    everyone: list[Master] = []
    winners: list[Master] = []
    try:
        racing = pair(0)
        everyone += racing
        for trial in range(TRIALS):
            for m in racing:
                m.wait_ready()
            for m in racing:  # open the gate for both, back to back
                m.open_gate()
            following = pair(trial + 1) if trial + 1 < TRIALS else []
            everyone += following
            deadline = time.monotonic() + RACE_TIMEOUT_S
            while all(m.proc.poll() is None for m in racing):
                assert time.monotonic() < deadline, f"trial {trial}: neither master gave way"
                time.sleep(0.02)
            loser = next(m for m in racing if m.proc.poll() is not None)
            winner = next(m for m in racing if m is not loser)
            assert loser.proc.returncode == 2, f"trial {trial}: {loser.text()}"
            assert f"already held by pid {winner.proc.pid}" in loser.text(), \
                f"trial {trial}: {loser.text()}"
            winners.append(winner)
            racing = following
        # Every winner runs on: it holds rank 0 of its run and waits for rank 1.
        time.sleep(0.5)
        for trial, winner in enumerate(winners):
            assert winner.proc.poll() is None, f"trial {trial}: the winner stopped: " \
                f"{winner.text()}"
            assert _claim_pid(winner.run_dir) == winner.proc.pid
            manifest = json.loads((winner.run_dir / "run.json").read_text())
            assert manifest["generation"] == 0
    finally:
        for m in everyone:
            if m.proc.poll() is None:
                m.proc.kill()
            m.proc.wait(timeout=30)
