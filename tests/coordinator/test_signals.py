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
from coordinator.machine.runtime import install_signal_handlers
install_signal_handlers()
try:
    # Inside the try: the test signals as soon as it reads this line, which on a
    # loaded machine can be before print has returned.
    print("ready", flush=True)
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


LOST = """
import os, signal, time
from coordinator.errors import Interrupted
from coordinator.machine.runtime import Runtime, install_signal_handlers
install_signal_handlers()
runtime = Runtime()
runtime.check()  # nothing asked yet
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
except Interrupted:
    pass  # swallowed, as logging does when the signal lands in a record's write
try:
    runtime.check()
except Interrupted as exc:
    print("stops:", exc, flush=True)
"""


def test_a_stop_request_whose_raise_was_swallowed_is_raised_again_by_the_next_check() -> None:
    """Under Slurm's requeue a daemon's SIGTERM landed inside a log record's write;
    logging printed "--- Logging error ---" and went on, and the daemon waited
    for its group instead of stopping.  Every wait's check now raises it again."""
    done = subprocess.run([sys.executable, "-c", LOST], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stops: interrupted by signal 15", done.stdout
