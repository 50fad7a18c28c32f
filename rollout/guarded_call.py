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
    start once ──────────────── spawn ────────> import M, resolve F (with `init_args`,
                                                F is a factory: F(*init_args) is called)
              <────────────── {"ready": true} ─┘
    call(args) ─── {"args": [...]} ───────────> F(*args)
              <─── {"value": v} | {"error": s} ┘
    no reply within the deadline: SIGKILL, reap, CallTimedOut; the next call
    starts a new child.  The child gone mid-call (killed, out of memory, a
    crash in C): WorkerDied naming how it ended, never a result; the next call
    starts a new child.

The child belongs to the process, not to the thread that first called: it is
forked by the process's spawner thread (coordinator/machine/lifetime.py) with
PR_SET_PDEATHSIG, so it dies with the process, even mid-computation, and
outlives the episode threads of agent plugins (rollout/agents.py), which
end after each episode.  EOF on the child's stdin (the parent gone) ends it
too while it waits for a request.

One request at a time per worker (a lock); the JSON-lines exchange costs tens
of microseconds, nothing beside the function's own work.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import importlib
import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any, Final

from coordinator.machine.lifetime import describe_exit, spawn

# Importing math-verify (sympy, antlr) takes 2-3 s on an idle core; a loaded
# 2-core machine running four daemons can take several times that.
DEFAULT_START_SECONDS: Final = 60.0
# A child whose stdout closed is reaped within this, or taken for one still
# running (then killed): exiting takes a dead process milliseconds.
_EXIT_GRACE_S: Final = 2.0
# A killed child is reaped within this, or left behind as stuck in the kernel.
_KILL_WAIT_S: Final = 30.0

log = logging.getLogger(__name__)


class GuardedCallError(RuntimeError):
    """The guarded function could not give a result."""


class CallTimedOut(GuardedCallError, TimeoutError):
    def __init__(self, message: str, *, seconds: float) -> None:
        super().__init__(message)
        self.seconds = seconds


class StartFailed(GuardedCallError):
    """The child could not make the function ready; `reason` says why, in its words."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class WorkerDied(GuardedCallError):
    """The child process ended during a call: there is no result, and none is made up."""

    def __init__(self, message: str, *, returncode: int | None) -> None:
        super().__init__(message)
        self.returncode = returncode


class _End(enum.Enum):
    """Why no reply came."""

    DEADLINE = "deadline"
    EXITED = "exited"  # EOF on the child's stdout


class GuardedWorker:
    """Calls `module:function` in a long-lived child process, each call under a deadline.

    Arguments and results must be JSON values.  An exception in the function
    comes back as GuardedCallError naming it; the child stays up.  With
    `init_args` (JSON values), `module:function` is a factory the child calls
    once with them to get the function it serves (rollout/reward_file.py loads a
    user's file that way); `label` names the worker in errors (the target
    otherwise).
    """

    def __init__(self, target: str, *, start_seconds: float = DEFAULT_START_SECONDS,
                 init_args: tuple[Any, ...] | None = None, label: str = "") -> None:
        if ":" not in target:
            raise ValueError(f"target {target!r} is not 'module:function', e.g. "
                             "'rollout.rewards:math_score'")
        self.target = target
        self.label = label or target
        self.start_seconds = start_seconds
        self.init_args = init_args
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
            except OSError as exc:  # BrokenPipeError: it died since the check above
                raise self._died(child, f"before the call ({exc})") from exc
            reply = self._read_line(child.stdout, seconds)
            if reply is _End.EXITED:
                raise self._died(child, "during the call")
            if reply is _End.DEADLINE:
                self._kill()
                raise CallTimedOut(f"{self.label}: no result within {seconds:g} s; the worker "
                                   "process was killed and a new one starts on the next call",
                                   seconds=seconds)
            if "error" in reply:
                raise GuardedCallError(f"{self.label}: {reply['error']}")
            return reply.get("value")

    def start(self) -> None:
        """Start the child now if none runs (StartFailed when it cannot be made ready)."""
        with self._lock:
            self._ensure_started()

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _died(self, child: subprocess.Popen[str], when: str) -> WorkerDied:
        returncode = self._kill(exited=True)
        how = describe_exit(returncode) if returncode is not None else \
            "its output closed and it was killed"
        return WorkerDied(f"{self.label}: the worker process (pid {child.pid}) died {when}: "
                          f"{how}; no result, and a new one starts on the next call",
                          returncode=returncode)

    def _ensure_started(self) -> subprocess.Popen[str]:
        if self._child is not None and self._child.poll() is None:
            return self._child
        self._kill()
        init = [] if self.init_args is None else [json.dumps(list(self.init_args))]
        child: subprocess.Popen[str] = spawn(
            [sys.executable, "-m", "rollout.guarded_call", self.target, *init],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._child = child
        assert child.stdout is not None
        ready = self._read_line(child.stdout, self.start_seconds)
        if not isinstance(ready, dict) or not ready.get("ready"):
            returncode = self._kill(exited=ready is _End.EXITED)
            why = ready.get("error") if isinstance(ready, dict) else \
                f"not ready within {self.start_seconds:g} s" if ready is _End.DEADLINE else \
                f"it ended before it was ready ({describe_exit(returncode)})"
            raise StartFailed(f"{self.label}: the worker process did not start: {why}",
                              reason=str(why))
        return child

    def _read_line(self, stream: IO[str], seconds: float) -> dict[str, Any] | _End:
        """The child's next reply, or why none came."""
        deadline = time.monotonic() + seconds
        with selectors.DefaultSelector() as selector:
            selector.register(stream, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(timeout=left):
                    return _End.DEADLINE
                line = stream.readline()
                if not line:
                    return _End.EXITED
                try:
                    reply = json.loads(line)
                except json.JSONDecodeError:
                    continue  # stray output of the function on stdout: not a reply
                if isinstance(reply, dict):
                    return reply

    def _kill(self, *, exited: bool = False) -> int | None:
        """Kill and reap the child; its exit status if it ended by itself (None: it was
        still running, so killed here).  `exited`: its stdout closed, so it is ending."""
        child, self._child = self._child, None
        if child is None:
            return None
        returncode = child.poll()
        if returncode is None and exited:
            # EOF on its stdout comes a moment before the exit is reapable.
            with contextlib.suppress(subprocess.TimeoutExpired):  # then it still runs
                returncode = child.wait(_EXIT_GRACE_S)
        if returncode is None:
            child.kill()
            try:
                child.wait(_KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                # Never reaped: it is left behind, named, and the next call starts a new
                # one; waiting on would hold every caller behind this worker's lock.
                log.error("%s: the worker process (pid %d) did not end within %g s of "
                          "SIGKILL: stuck in the kernel (e.g. reading a file of a shared "
                          "filesystem whose server is gone); left behind", self.label,
                          child.pid, _KILL_WAIT_S)
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()
        return returncode


def _resolve(target: str, init: str | None = None) -> Callable[..., Any]:
    module_name, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module_name), name)
    if init is not None:
        fn = fn(*json.loads(init))
    if not callable(fn):
        raise TypeError(f"{target} is not callable")
    return fn  # type: ignore[no-any-return]


def _serve(target: str, init: str | None = None) -> int:
    # Replies go to a private copy of the reply pipe only; whatever the function
    # writes goes to stderr, from Python (sys.stdout) or not (fd 1: a C library, a
    # program it runs), so no stray output ever joins or splits a reply.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        fn = _resolve(target, init)
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
    sys.exit(_serve(*sys.argv[1:3]))
