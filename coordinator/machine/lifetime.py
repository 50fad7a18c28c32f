"""Child processes that die with this process, whichever of its threads starts them.

Linux's PR_SET_PDEATHSIG sends its signal when the *thread* that forked the
child ends, not the process: a child forked by an agent's episode thread, or
by the thread that rolls out ahead of training (rl/ahead.py), would be
SIGKILLed as soon as that thread returns, with the daemon still running (a
math reward worker died that way between two calls).  So every such child is
forked by one spawner thread that is started once and never returns: its end
is the process's end.

    caller (any thread)                  spawner thread (one per process, never returns)
    ───────────────────                  ──────────────────────────────────────────────
    spawn(argv, ...) ── job ───────────> subprocess.Popen(argv, preexec_fn=...)
                                           child, between fork and exec:
                                             prctl(PR_SET_PDEATHSIG, SIGKILL)
                                             parent already gone? exit at once
         <──────────── Popen | error ────┘
    the caller owns the Popen from here on (poll, wait, kill from any thread)

A forked copy of this process (os.fork without exec) starts its own spawner
on first use: threads do not survive a fork.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Final

_PR_SET_PDEATHSIG: Final = 1  # from <linux/prctl.h>

# Loaded once in the parent: dlopen in the forked child could deadlock on a
# loader lock held by another thread at fork time.
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True) \
    if sys.platform.startswith("linux") else None


def describe_exit(returncode: int | None) -> str:
    """'exit status 3' / 'killed by SIGKILL (-9)' / 'still running'."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name} ({returncode})"
    return f"exit status {returncode}"


def _die_with(parent_pid: int) -> Callable[[], None] | None:
    """The child's first act: SIGKILL when the spawner thread, that is this process,
    ends; None off Linux (the callers' other guards, EOF on a pipe, remain)."""
    if _LIBC is None:
        return None
    prctl = _LIBC.prctl

    def preexec() -> None:
        # Runs in the child between fork and exec: keep it to two syscalls.
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The parent may have died before prctl took effect: then nobody would
        # ever send the signal, so exit now instead of running orphaned.
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


_Job = tuple[Callable[[], "subprocess.Popen[Any]"], "Future[subprocess.Popen[Any]]"]


class _Spawner:
    """The thread that forks every child; it never returns."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def run(self, make: Callable[[], subprocess.Popen[Any]]) -> subprocess.Popen[Any]:
        with self._lock:
            if self._thread is None:
                # A daemon thread: it must not hold up the interpreter's exit,
                # and it ends only with the process.
                self._thread = threading.Thread(target=self._serve, name="child-spawner",
                                                daemon=True)
                self._thread.start()
        done: Future[subprocess.Popen[Any]] = Future()
        self._jobs.put((make, done))
        return done.result()

    def _serve(self) -> None:
        while True:
            make, done = self._jobs.get()
            try:
                done.set_result(make())
            except BaseException as exc:  # handed to the caller; this thread goes on
                done.set_exception(exc)

    def forget(self) -> None:
        """In a forked child: the parent's spawner thread does not exist here."""
        self._lock = threading.Lock()
        self._jobs = queue.SimpleQueue()
        self._thread = None


_SPAWNER: Final = _Spawner()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_SPAWNER.forget)


def spawn(argv: Any, **popen_kwargs: Any) -> subprocess.Popen[Any]:
    """subprocess.Popen(argv, **popen_kwargs), forked by the process's spawner thread,
    the child set to be SIGKILLed when this process dies (not when the calling
    thread ends).  Errors of Popen (a missing program) are raised here."""
    if "preexec_fn" in popen_kwargs:
        raise ValueError("spawn() sets preexec_fn itself (the death signal): pass no other")
    preexec = _die_with(os.getpid())
    return _SPAWNER.run(lambda: subprocess.Popen(argv, preexec_fn=preexec, **popen_kwargs))
