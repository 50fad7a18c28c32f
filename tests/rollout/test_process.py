from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from rollout.engines.engine import GpuNotReleased
from rollout.engines.process import (
    ManagedProcess,
    describe_exit,
    free_port,
    log_tail,
    nvidia_smi_query,
    parse_nvidia_smi_apps,
    wait_gpu_released,
)

PY = sys.executable


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def reap() -> Iterator[list[int]]:
    """Kill anything a failing test left behind."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _spawn_tree_script(pid_file: Path, *, ignore_term: bool = False) -> list[str]:
    # A server that forks one worker in its group and one that leaves the
    # group (start_new_session), like vLLM's engine-core processes.
    code = textwrap.dedent(f"""
        import json, signal, subprocess, sys, time
        if {ignore_term!r}:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sleeper = [sys.executable, "-c", "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN) if {ignore_term!r} else None; time.sleep(60)"]
        a = subprocess.Popen(sleeper)
        b = subprocess.Popen(sleeper, start_new_session=True)
        open({str(pid_file)!r}, "w").write(json.dumps([a.pid, b.pid]))
        print("tree up", flush=True)
        time.sleep(60)
    """)
    return [PY, "-c", code]


def test_stop_terminates_the_whole_tree_including_a_worker_that_left_the_group(
    tmp_path: Path, reap: list[int]
) -> None:
    pid_file = tmp_path / "pids.json"
    mp = ManagedProcess(_spawn_tree_script(pid_file), log_path=tmp_path / "s.log", env=os.environ)
    reap.append(mp.pid)
    assert _wait_for(pid_file.exists)
    workers = json.loads(pid_file.read_text())
    reap.extend(workers)
    assert set(workers) <= set(mp.pids())

    report = mp.stop(grace_s=5.0)

    assert report.clean and not report.escalated_to_sigkill
    assert report.returncode == -signal.SIGTERM
    assert all(_gone(p) for p in [mp.pid, *workers])
    assert set(workers) <= set(report.tree_pids)


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path: Path, reap: list[int]) -> None:
    pid_file = tmp_path / "pids.json"
    mp = ManagedProcess(
        _spawn_tree_script(pid_file, ignore_term=True), log_path=tmp_path / "s.log", env=os.environ
    )
    reap.append(mp.pid)
    assert _wait_for(pid_file.exists)
    workers = json.loads(pid_file.read_text())
    reap.extend(workers)

    t0 = time.monotonic()
    report = mp.stop(grace_s=0.5, kill_timeout_s=5.0)

    assert report.escalated_to_sigkill
    assert report.returncode == -signal.SIGKILL
    assert describe_exit(report.returncode) == "killed by SIGKILL (-9)"
    assert not report.survivors
    assert all(_gone(p) for p in [mp.pid, *workers])
    assert time.monotonic() - t0 < 5.0


def _daemon_with_server(tmp_path: Path, reap: list[int], *, from_thread: bool
                        ) -> tuple[subprocess.Popen[bytes], int]:
    """A daemon process that starts a server (a sleeping child) through ManagedProcess,
    from its main thread or from a thread that then ends; the daemon and the server's pid."""
    child_file = tmp_path / "child.json"
    daemon_code = textwrap.dedent(f"""
        import json, os, sys, threading, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from rollout.engines.process import ManagedProcess
        started = []
        def start():
            started.append(ManagedProcess([sys.executable, "-c", "import time; time.sleep(60)"],
                                          log_path={str(tmp_path / "c.log")!r}, env=os.environ))
        if {from_thread!r}:
            thread = threading.Thread(target=start)
            thread.start()
            thread.join()
        else:
            start()
        open({str(child_file)!r}, "w").write(json.dumps(started[0].pid))
        time.sleep(60)
    """)
    daemon = subprocess.Popen([PY, "-c", daemon_code])
    reap.append(daemon.pid)
    assert _wait_for(child_file.exists)
    child = json.loads(child_file.read_text())
    reap.append(child)
    return daemon, child


def test_server_dies_when_the_daemon_that_started_it_is_sigkilled(
    tmp_path: Path, reap: list[int]
) -> None:
    daemon, child = _daemon_with_server(tmp_path, reap, from_thread=False)
    assert not _gone(child)

    daemon.kill()
    daemon.wait()

    assert _wait_for(lambda: _gone(child), 5.0), "server outlived its SIGKILLed daemon"


def test_a_server_started_from_a_thread_that_ends_lives_until_its_daemon_dies(
    tmp_path: Path, reap: list[int]
) -> None:
    """PR_SET_PDEATHSIG fires when the forking *thread* ends: the rollout ahead of
    training (rl/ahead.py) may start the engine from a thread that then returns."""
    daemon, child = _daemon_with_server(tmp_path, reap, from_thread=True)
    # The signal, were it tied to the thread, comes as the thread exits: well
    # within a second even on a loaded machine.
    time.sleep(1.0)
    assert not _gone(child), "the server died with the thread that started it"

    daemon.kill()
    daemon.wait()

    assert _wait_for(lambda: _gone(child), 5.0), "server outlived its SIGKILLed daemon"


def test_log_tail_shows_the_last_lines_of_the_current_run_only(tmp_path: Path) -> None:
    log = tmp_path / "s.log"
    log.write_text("old run line\n" * 3)
    mp = ManagedProcess(
        [PY, "-c", "print('\\n'.join(f'line {i}' for i in range(100)))"],
        log_path=log,
        env=os.environ,
    )
    mp._popen.wait(10)
    assert mp.log_tail(3) == "line 97\nline 98\nline 99"
    assert "old run line" not in mp.log_tail(500)
    assert log_tail(tmp_path / "missing.log") == ""
    fresh = tmp_path / "fresh" / "s.log"
    ManagedProcess([PY, "-c", "pass"], log_path=fresh, env=os.environ)._popen.wait(10)
    assert fresh.stat().st_mode & 0o022 == 0


def test_free_port_can_be_bound(tmp_path: Path) -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_nvidia_smi_rows_are_parsed_and_junk_lines_skipped() -> None:
    text = "1234, 1024 MiB\n5678, [N/A]\nNo devices were found\n\n1234, 10 MiB\n"
    assert parse_nvidia_smi_apps(text) == {1234: 1034, 5678: 0}


def test_wait_gpu_released_returns_at_once_with_no_gpu_tool(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi; pynvml is not installed here
    monkeypatch.setitem(sys.modules, "pynvml", None)
    t0 = time.monotonic()
    wait_gpu_released([os.getpid()], 30.0)
    assert time.monotonic() - t0 < 1.0


def test_wait_gpu_released_names_the_pids_still_holding_memory_then_sees_release(
    tmp_path: Path,
) -> None:
    # A stand-in nvidia-smi with the real command-line interface: it prints
    # whatever rows the test puts in a file.
    rows = tmp_path / "rows.csv"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat {rows}\n")
    smi.chmod(0o755)
    rows.write_text("4242, 1024 MiB\n999, 5 MiB\n")
    now = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    holders = wait_gpu_released(
        [4242, 7],
        2.0,
        query=nvidia_smi_query(str(smi)),
        poll_s=0.5,
        sleep=sleep,
        clock=lambda: now[0],
    )
    assert holders == {4242: 1024}
    assert sleeps == [0.5] * 4
    assert "pid 4242 (1024 MiB)" in str(GpuNotReleased(holders, 2.0))

    rows.write_text("999, 5 MiB\n")
    assert wait_gpu_released(
        [4242, 7], 2.0, query=nvidia_smi_query(str(smi)), sleep=sleep, clock=lambda: now[0]
    ) == {}


def test_a_gpu_query_that_never_answers_is_named_as_a_hung_driver_not_waited_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NVML runs in-process: a wedged driver blocks the call.  Each query answers within
    GPU_QUERY_S (30 s; 0.3 s here) or the wait fails naming the driver."""
    import threading

    from rollout.engines import process

    monkeypatch.setattr(process, "GPU_QUERY_S", 0.3)
    hung = threading.Event()
    t0 = time.monotonic()
    try:
        with pytest.raises(process.GpuQueryHung, match=r"did not answer a query of its "
                           r"processes \(NVML or nvidia-smi\) within 0.3 s: it may be hung"):
            wait_gpu_released([4242], 600.0, query=lambda: hung.wait(60) and {})  # type: ignore[return-value,arg-type]
        assert time.monotonic() - t0 < 10
    finally:
        hung.set()
    # A query that raises: its own error, as before.
    with pytest.raises(subprocess.CalledProcessError):
        wait_gpu_released([4242], 1.0, query=lambda: (_ for _ in ()).throw(
            subprocess.CalledProcessError(9, "nvidia-smi")))
