"""A function run in a child process that is killed when it overruns.

Why a process: math-verify bounds sympy with signal.alarm, and an alarm is
not a deadline.  Python runs the handler only between bytecodes of the main
thread, so a long big-integer operation in C delays it for minutes, and when
the handler's exception lands inside a weakref callback or a __del__, Python
prints it and drops it: the computation goes on (CI saw one reward call run
579 s against a 1 s timeout).  Only killing the process that computes is a
deadline that always holds.

    parent (any thread)                         child: python -m rollout.guarded_call M:F
    ───────────────────                         ─────────────────────────────────────────
    start once ──────────────── spawn ────────> import M, resolve F
              <────────────── {"ready": true} ─┘
    call(args) ─── {"args": [...]} ───────────> F(*args)
              <─── {"value": v} | {"error": s} ┘
    no reply within the deadline: SIGKILL, reap, CallTimedOut; the next call
    starts a new child.  EOF on the child's stdin (the parent gone) ends it.

One request at a time per worker (a lock); the JSON-lines exchange costs tens
of microseconds, nothing beside the function's own work.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any, Final

# Importing math-verify (sympy, antlr) takes 2-3 s on an idle core; a loaded
# 2-core machine running four daemons can take several times that.
DEFAULT_START_SECONDS: Final = 60.0


class GuardedCallError(RuntimeError):
    """The guarded function could not give a result."""


class CallTimedOut(GuardedCallError, TimeoutError):
    def __init__(self, message: str, *, seconds: float) -> None:
        super().__init__(message)
        self.seconds = seconds


class GuardedWorker:
    """Calls `module:function` in a long-lived child process, each call under a deadline.

    Arguments and results must be JSON values.  An exception in the function
    comes back as GuardedCallError naming it; the child stays up.
    """

    def __init__(self, target: str, *, start_seconds: float = DEFAULT_START_SECONDS) -> None:
        if ":" not in target:
            raise ValueError(f"target {target!r} is not 'module:function', e.g. "
                             "'rollout.rewards:math_score'")
        self.target = target
        self.start_seconds = start_seconds
        self._lock = threading.Lock()
        self._child: subprocess.Popen[str] | None = None
        atexit.register(self.close)

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    def call(self, *args: Any, seconds: float) -> Any:
        with self._lock:
            child = self._ensure_started()
            assert child.stdin is not None and child.stdout is not None
            try:
                child.stdin.write(json.dumps({"args": list(args)}) + "\n")
                child.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                self._kill()
                raise GuardedCallError(f"{self.target}: the worker process died ({exc})") from exc
            reply = self._read_line(child.stdout, seconds)
            if reply is None:
                self._kill()
                raise CallTimedOut(f"{self.target}: no result within {seconds:g} s; the worker "
                                   "process was killed and a new one starts on the next call",
                                   seconds=seconds)
            if "error" in reply:
                raise GuardedCallError(f"{self.target}: {reply['error']}")
            return reply.get("value")

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _ensure_started(self) -> subprocess.Popen[str]:
        if self._child is not None and self._child.poll() is None:
            return self._child
        self._kill()
        child = subprocess.Popen(
            [sys.executable, "-m", "rollout.guarded_call", self.target],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._child = child
        assert child.stdout is not None
        ready = self._read_line(child.stdout, self.start_seconds)
        if ready is None or not ready.get("ready"):
            self._kill()
            why = ready.get("error") if ready else f"not ready within {self.start_seconds:g} s"
            raise GuardedCallError(f"{self.target}: the worker process did not start: {why}")
        return child

    def _read_line(self, stream: IO[str], seconds: float) -> dict[str, Any] | None:
        """The child's next reply, or None past the deadline or at its exit."""
        deadline = time.monotonic() + seconds
        with selectors.DefaultSelector() as selector:
            selector.register(stream, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(timeout=left):
                    return None
                line = stream.readline()
                if not line:
                    return None  # the child exited
                try:
                    reply = json.loads(line)
                except json.JSONDecodeError:
                    continue  # stray output of the function on stdout: not a reply
                if isinstance(reply, dict):
                    return reply

    def _kill(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        if child.poll() is None:
            child.kill()
        child.wait()
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()


def _resolve(target: str) -> Callable[..., Any]:
    module_name, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module_name), name)
    if not callable(fn):
        raise TypeError(f"{target} is not callable")
    return fn  # type: ignore[no-any-return]


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, even mid-computation
    (EOF on stdin ends it only while it waits for a request)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig: Final = 1
    with contextlib.suppress(OSError):  # no libc by that name: EOF still ends it
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _serve(target: str) -> int:
    _die_with_parent()
    # Replies go to the real stdout only; whatever the function prints goes to stderr.
    out = sys.stdout
    sys.stdout = sys.stderr
    try:
        fn = _resolve(target)
    except Exception as exc:
        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            reply = {"value": fn(*json.loads(line)["args"])}
        except BaseException as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1]))
