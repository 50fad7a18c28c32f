from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from rollout.guarded_call import CallTimedOut, GuardedCallError, GuardedWorker, WorkerDied


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


def test_the_worker_outlives_the_thread_that_started_it() -> None:
    """Agent plugins call rewards from one thread per episode, each ending after its
    episode: the worker must belong to the process (PR_SET_PDEATHSIG is per thread)."""
    worker = GuardedWorker("math:hypot")
    try:
        thread = threading.Thread(target=worker.call, args=(3, 4), kwargs={"seconds": 30})
        thread.start()
        thread.join(timeout=60)
        first = worker.pid
        assert first is not None
        # A death signal tied to the thread comes as it exits: well within this.
        time.sleep(1.0)
        assert worker.call(6, 8, seconds=30) == 10.0
        assert worker.pid == first, "the worker died with the thread that started it"
    finally:
        worker.close()


def test_a_worker_that_dies_during_a_call_is_named_never_taken_for_a_timeout() -> None:
    worker = GuardedWorker("time:sleep")
    try:
        worker.call(0, seconds=30)
        pid = worker.pid
        assert pid is not None
        errors: list[BaseException] = []

        def call() -> None:
            try:
                worker.call(600, seconds=60)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=call)
        thread.start()
        time.sleep(0.5)  # the request is in the worker (a kill before it: the same error)
        os.kill(pid, signal.SIGKILL)  # as the kernel's OOM killer would
        thread.join(timeout=30)
        assert len(errors) == 1
        assert isinstance(errors[0], WorkerDied) and not isinstance(errors[0], CallTimedOut)
        assert errors[0].returncode == -signal.SIGKILL
        assert f"the worker process (pid {pid}) died" in str(errors[0])
        assert "killed by SIGKILL (-9)" in str(errors[0])
        assert worker.call(0, seconds=30) is None  # a new worker takes the next call
        assert worker.pid not in (None, pid)
    finally:
        worker.close()


def test_output_written_to_fd_1_by_the_function_never_joins_or_hides_a_reply() -> None:
    """A reward that runs a program (or a C library writing to fd 1): its output goes
    to stderr.  On the reply pipe, a partial line joined the reply (lost, then a
    timeout scored 0) and a whole line read with it hid the reply in a buffer."""
    worker = GuardedWorker("os:system")
    try:
        start = time.monotonic()
        assert worker.call("printf stray-without-a-newline", seconds=20) == 0
        assert worker.call("echo a-stray-line", seconds=20) == 0
        assert time.monotonic() - start < 15  # answered, not waited out
    finally:
        worker.close()
