"""`coordinator demo` end to end: 3 simulated nodes, 2 iterations, its table and its PNG."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_the_demo_runs_three_nodes_for_two_iterations_and_draws_its_reward_curve(
    tmp_path: Path,
) -> None:
    run = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "rl", "demo", "--log-path", str(run), "--nodes", "3",
         "--iterations", "2", "--eval-interval", "1"],
        capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "coordinator demo: per iteration" in out
    table = [line for line in out.splitlines() if line.startswith("│")]
    rows = [cells for line in table
            if (cells := [c.strip() for c in line.strip("│").split("│")])[0] in ("0", "1")]
    assert [r[0] for r in rows] == ["0", "1"], out[-4000:]
    header = next(line for line in out.splitlines() if line.startswith("┃ iter"))
    assert [c.strip() for c in header.strip("┃").split("┃")][4:6] == ["samples", "failed"]
    for cells in rows:
        assert float(cells[1]) >= 0.0  # the iteration's mean train reward
        assert int(cells[4]) == 128 * 8 and int(cells[5]) == 0  # samples trained, failed
        assert float(cells[-1]) > 0.0  # its seconds
    assert float(rows[1][2]) >= 0.0  # eval accuracy, evaluated with --eval-interval 1
    assert "3 nodes, 2 iterations in" in out
    png = run / "reward-curve.png"
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert (width, height) == (600, 350)  # figsize 6 x 3.5 in at 100 dpi
    assert f"reward curve: {png}" in out
    # The engines stayed up: each rank's phase-12 payload names one process,
    # reloaded in place, serving what the trainer published.
    for rank in range(3):
        served = [json.loads((run / f"iterations/{it:06d}/phase-12/arrive-{rank}.json")
                             .read_text())["payload"] for it in (0, 1)]
        assert [s["engine"] for s in served] == ["reloaded", "reloaded"], served
        assert served[0]["engine_pid"] == served[1]["engine_pid"]
        assert all(s["probe_mean_abs_diff"] <= s["probe_tolerance"] for s in served)
