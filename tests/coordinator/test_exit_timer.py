"""The last-resort exit timer (coordinator/machine/runtime.py), in real processes:
it ends a daemon whose main thread ignores a failure, and leaves alone one whose
main thread holds the failure and is stopping in order."""

from __future__ import annotations

import subprocess
import sys

import pytest

# The main thread is busy 3 s after a peer's failure (an engine stopping, say);
# the grace is 0.5 s.  With `in_hand` it has said it holds the failure.
SCRIPT = """
import sys, threading, time
from coordinator.errors import CoordinatorError
from coordinator.machine.runtime import Runtime
runtime = Runtime(cancel_grace_s=0.5)
peer = threading.Thread(target=runtime.fail, args=(CoordinatorError("rank 1 failed"),))
peer.start(); peer.join()
if sys.argv[1] == "in_hand":
    runtime.in_hand()
time.sleep(3)
print("the main thread stopped in order", flush=True)
"""


@pytest.mark.parametrize("held", [False, True], ids=["ignored", "in_hand"])
def test_the_timer_exits_a_daemon_that_ignores_a_failure_not_one_that_holds_it(
        held: bool) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, "in_hand" if held else "no"],
                          capture_output=True, text=True, timeout=60)
    if held:
        assert done.returncode == 0, done.stderr
        assert "stopped in order" in done.stdout
        assert "did not stop within" not in done.stderr
    else:
        assert done.returncode == 1, (done.returncode, done.stderr)  # CoordinatorError's
        assert "stopped in order" not in done.stdout
        assert "the main thread did not stop within 0.5 s; exiting now" in done.stderr
