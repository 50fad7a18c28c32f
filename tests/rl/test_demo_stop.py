"""Ctrl-C in `coordinator demo` (rl/demo.py stop_daemons): every daemon is asked to stop
(SIGTERM), waited for with a deadline, and one that does not stop is killed."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time

import pytest
from rich.console import Console

from rl import demo


def test_daemons_are_asked_to_stop_then_one_that_does_not_is_killed_at_the_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "STOP_S", 1.0)
    stops = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stubborn = subprocess.Popen([sys.executable, "-c", (
        "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(60)")], stdout=subprocess.PIPE)
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
    out = io.StringIO()
    started = time.monotonic()
    try:
        demo.stop_daemons({0: stops, 1: stubborn}, Console(file=out))
        assert stops.wait(timeout=5) == -signal.SIGTERM
        assert stubborn.wait(timeout=5) == -signal.SIGKILL
        assert time.monotonic() - started < 15  # the 1 s deadline, not the 60 s sleeps
    finally:
        for p in (stops, stubborn):
            p.kill()
            p.wait()
    assert "stopping 2 daemon(s)" in out.getvalue() and "Ctrl-C again kills" in out.getvalue()
