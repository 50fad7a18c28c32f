from __future__ import annotations

import os
import time

import pytest

from rollout.guarded_call import CallTimedOut, GuardedCallError, GuardedWorker


def test_a_call_returns_its_value_and_the_worker_stays_up_between_calls() -> None:
    worker = GuardedWorker("math:hypot")
    try:
        assert worker.call(3, 4, seconds=30) == 5.0
        pid = worker.pid
        assert worker.call(6, 8, seconds=30) == 10.0
        assert worker.pid == pid
    finally:
        worker.close()


def test_an_overrunning_call_is_killed_at_its_deadline_and_the_next_call_gets_a_new_worker() -> None:
    worker = GuardedWorker("time:sleep")
    try:
        worker.call(0, seconds=30)  # started: what follows times the call alone
        first = worker.pid
        assert first is not None
        start = time.monotonic()
        with pytest.raises(CallTimedOut, match=r"no result within 0\.5 s"):
            worker.call(600, seconds=0.5)
        # Generous for a loaded machine, and far below the 600 s asked for.
        assert time.monotonic() - start < 10
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)  # killed and reaped, not left running
        worker.call(0, seconds=30)
        assert worker.pid not in (None, first)
    finally:
        worker.close()


def test_an_exception_in_the_function_comes_back_named_and_the_worker_survives() -> None:
    worker = GuardedWorker("math:sqrt")
    try:
        with pytest.raises(GuardedCallError, match=r"ValueError: .*domain"):
            worker.call(-1, seconds=30)
        assert worker.call(9, seconds=30) == 3.0
    finally:
        worker.close()


def test_a_target_that_does_not_import_is_reported_at_start() -> None:
    worker = GuardedWorker("no_such_module_here:f")
    with pytest.raises(GuardedCallError, match="did not start: ModuleNotFoundError"):
        worker.call(seconds=30)
    with pytest.raises(ValueError, match="not 'module:function'"):
        GuardedWorker("nocolon")
