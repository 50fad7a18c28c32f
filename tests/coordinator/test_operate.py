"""Watching a run: `status --watch` live, `timeline` from the timing records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.ops.timeline import SpanKind, load
from tests.support.cluster import LocalCluster, write_config

pytestmark = pytest.mark.slow


def test_status_watch_follows_a_run_until_every_daemon_has_stopped(tmp_path: Path) -> None:
    # 4 iterations of >= 1 s each (the master sleeps in phase 5): several refreshes.
    config = write_config(tmp_path / "c.toml", iterations=4, scripted='sleeps = ["0:*:5:1.0"]')
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=3, config=config)
    try:
        c.start_all()
        c.wait_until(lambda: c.at_phase(0, 0, 5), 60, "the run under way")
        watch = subprocess.run(
            [sys.executable, "-m", "coordinator_cli", "status", "--run-dir", str(c.run_dir), "--watch",
             "--interval", "0.5"], capture_output=True, text=True, timeout=120)
        codes = c.wait_all(timeout=60)
        assert codes == {0: 0, 1: 0, 2: 0}
    finally:
        c.close()
    assert watch.returncode == 0, watch.stderr
    out = watch.stdout
    refreshes = out.count("(refreshed every 0.5 s)")
    assert refreshes >= 4, out  # not a tty: each refresh printed after a timestamp
    assert out.rstrip().endswith("every daemon has stopped (finished)"), out[-500:]
    shown = {int(line.split("│")[4].strip()) for line in out.splitlines()
             if line.startswith("│ 0 ") and line.split("│")[4].strip().isdigit()}
    assert len(shown) >= 2, shown  # the master's iteration moved between refreshes


def test_status_watch_refuses_bad_options(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    for args, message in ((["--interval", "0"], "--interval 0 is outside 0.1..600"),
                          (["--json"], "--watch and --json do not go together")):
        done = subprocess.run([sys.executable, "-m", "coordinator_cli", "status", "--run-dir",
                               str(tmp_path / "run"), "--watch", *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_timeline_skips_malformed_timing_records_and_refuses_a_bad_format(
        tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", iterations=2)
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=2, config=config)
    try:
        c.start_all()
        assert c.wait_all(timeout=60) == {0: 0, 1: 0}
    finally:
        c.close()
    bad = c.run_dir / "iterations/000001/timings/rank-1.json"
    record = json.loads(bad.read_text())
    record["phases"]["3"]["arrived_at"] = "soon"  # a value a hostile writer could leave
    bad.write_text(json.dumps(record))
    drawn = load(c.run_dir)
    assert drawn.skipped == 1
    assert {(s.rank, s.iteration) for s in drawn.spans} == {(0, 0), (1, 0), (0, 1)}
    assert {s.kind for s in drawn.spans} == set(SpanKind)
    done = subprocess.run([sys.executable, "-m", "coordinator_cli", "timeline", "--run-dir",
                           str(c.run_dir), "--out", str(tmp_path / "t.svg")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "give a file ending in .png or .html" in done.stderr
    # A damaged recoveries.json is not a timing file, and its recoveries are unknown, not 0.
    (c.run_dir / "recoveries.json").write_text("{not json")
    drawn = load(c.run_dir)
    assert drawn.skipped == 1 and drawn.recoveries == () and drawn.recoveries_unread
    done = subprocess.run([sys.executable, "-m", "coordinator_cli", "timeline", "--run-dir",
                           str(c.run_dir), "--out", str(tmp_path / "t.html")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "recoveries unknown (recoveries.json unreadable), 1 unreadable timing files " \
        "skipped" in done.stdout, done.stdout
    page = (tmp_path / "t.html").read_text()
    assert "unknown: recoveries.json could not be read" in page
    assert "1 unreadable timing file(s) skipped" in page


def test_status_over_a_window_shorter_than_a_beat_never_calls_a_live_rank_lost(
        tmp_path: Path) -> None:
    """A rank beats every 2 s here; `status --window 0.5` often sees no new beat from
    it.  That is no evidence: it stays running (judged by its age against the lease),
    where it used to be shown lost, and `--watch --interval 0.5` ended on "every daemon
    has stopped (lost)".  A window of the beat and its slack still finds a killed
    rank lost at once."""
    config = write_config(tmp_path / "c.toml", iterations=1, lease=8.0,
                          scripted='sleeps = ["0:0:5:60"]')
    config.write_text(config.read_text().replace("heartbeat_interval_s = 0.5",
                                                 "heartbeat_interval_s = 2.0"))
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=1, config=config)

    def status(window: float) -> dict[str, object]:
        done = subprocess.run(
            [sys.executable, "-m", "coordinator_cli", "status", "--run-dir", str(c.run_dir),
             "--json", "--window", str(window)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        rank: dict[str, object] = json.loads(done.stdout)["ranks"][0]
        return rank

    try:
        c.start_all()
        c.wait_until(lambda: c.at_phase(0, 0, 5), 60, "the master asleep in phase 5")
        seen = [status(0.5) for _ in range(4)]
        # Each window of 0.5 s sees one of the 2 s beats about a quarter of the time:
        # all four see one about once in 250 runs.  A window that saw none is undecided.
        assert {r["state"] for r in seen} == {"running"}, seen
        assert {r["advancing"] for r in seen} <= {True, None}, seen
        c.kill(0)
        dead = status(3.0)  # the beat (2 s) and its slack (1 s): conclusive
        assert dead["state"] == "lost" and dead["advancing"] is False, dead
    finally:
        c.close()
