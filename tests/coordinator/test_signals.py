"""A stop signal delivered twice at once (Slurm's scancel: slurmstepd signals every
task and srun forwards the same signal) is one request; a second one later kills."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

SCRIPT = """
import sys, time
from coordinator.errors import Interrupted
from coordinator.runtime import install_signal_handlers
install_signal_handlers()
print("ready", flush=True)
try:
    time.sleep(60)
except Interrupted:
    print("stopping", flush=True)
    time.sleep(float(sys.argv[1]))  # a graceful stop that takes a while
    sys.exit(130)
"""


@pytest.mark.parametrize(("second_after_s", "code"), [(0.2, 130), (2.6, -signal.SIGTERM)])
def test_a_second_sigterm_is_the_same_request_within_the_window_and_kills_after_it(
        second_after_s: float, code: int) -> None:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, "4"], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "stopping"
        time.sleep(second_after_s)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == code
    finally:
        proc.kill()
        proc.wait()
