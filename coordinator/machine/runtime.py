"""What a daemon shares between its threads: the first failure and its children.

The main thread runs actions and barriers; the heartbeat and monitor threads
watch peers.  Whoever sees trouble first calls `Runtime.fail`: the failure is
recorded (first one wins), the cancel event is set, the daemon's child
process trees (engine, torchrun) are killed at once, and, if the main thread
does not wind up within the grace period, a last-resort timer publishes the
failure and exits the process.  A survivor therefore stops within the lease
plus a few seconds even if an action ignores cancellation.

Once the main thread has left its action it says it holds the failure
(`in_hand()`): the timer is disarmed and the daemon stops in order, each step
bounded by its own timeout.  With coordination.on_failure "wait" it may go on
instead (coordinator/machine/regroup.py): `resume()` also clears the failure
and the cancel event.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Final

import psutil

from coordinator.errors import Cancelled, CoordinatorError, Interrupted

log = logging.getLogger(__name__)


def kill_tree(pid: int, *, grace_s: float = 2.0) -> list[int] | None:
    """SIGTERM a process and all its descendants, SIGKILL what remains.

    Descendants are collected before signalling, so children that re-parent
    to init when their parent dies are still found.  Returns the PIDs that
    needed SIGKILL, or None when the process had already exited.
    """
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):  # it exited meanwhile: fine
            proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):  # it exited meanwhile: fine
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    return [p.pid for p in alive]


class Runtime:
    """Cancellation, the first failure, and the child processes to kill."""

    def __init__(self, *, cancel_grace_s: float = 2.0) -> None:
        self.cancel = threading.Event()
        self.cancel_grace_s = cancel_grace_s
        self._lock = threading.Lock()
        self._failure: CoordinatorError | None = None
        self._children: dict[int, str] = {}
        self._last_words: Callable[[CoordinatorError], None] | None = None
        self._on_fail: list[Callable[[CoordinatorError], None]] = []
        self.finished = threading.Event()
        # Set when the main thread has taken the current failure in hand.
        self._handled = threading.Event()

    @property
    def failure(self) -> CoordinatorError | None:
        return self._failure

    def on_last_words(self, hook: Callable[[CoordinatorError], None]) -> None:
        """What the exit timer publishes before os._exit (the final heartbeat)."""
        self._last_words = hook

    def on_fail(self, hook: Callable[[CoordinatorError], None]) -> None:
        """Run `hook` in the failing thread, before children are killed."""
        self._on_fail.append(hook)

    def add_child(self, pid: int, what: str) -> None:
        with self._lock:
            self._children[pid] = what

    def remove_child(self, pid: int) -> None:
        with self._lock:
            self._children.pop(pid, None)

    def kill_children(self) -> None:
        with self._lock:
            children = dict(self._children)
        for pid, what in children.items():
            killed = kill_tree(pid, grace_s=1.0)
            if killed is None:  # its owner stopped it already (a normal finish)
                log.debug("%s (pid %d) had already exited", what, pid)
            else:
                log.warning("stopped %s (pid %d)%s", what, pid,
                            f"; SIGKILL needed for {killed}" if killed else "")
            self.remove_child(pid)

    def fail(self, error: CoordinatorError) -> bool:
        """Record the first failure and start stopping; False if one was recorded."""
        with self._lock:
            if self._failure is not None:
                return False
            self._failure = error
        log.error("%s", error)
        self.cancel.set()
        for hook in self._on_fail:
            try:
                hook(error)
            except Exception:  # a failing hook must not stop the shutdown
                log.exception("failure hook raised")
        handled = self._handled
        threading.Thread(target=self._stop_soon, args=(handled,), name="stop-timer",
                         daemon=True).start()
        return True

    def in_hand(self) -> None:
        """The main thread has left its action and holds the failure: disarm the exit
        timer.  What it does next (close the engines and the trainer, the last
        heartbeat, the claim) is bounded by each step's own timeout; racing the
        timer, a slow engine stop would lose the message that says why the run
        stops, and its exit code.  Called for an error the main thread raised itself,
        before `fail` records it, it disarms the timer that recording starts."""
        with self._lock:
            handled = self._handled
        handled.set()

    def resume(self) -> CoordinatorError | None:
        """The main thread goes on after the failure: disarm the exit timer, clear the
        failure and the cancel event.  Returns the failure that was cleared."""
        with self._lock:
            error, handled = self._failure, self._handled
            self._failure = None
            self._handled = threading.Event()
            self.cancel.clear()
        handled.set()
        return error

    def _stop_soon(self, handled: threading.Event) -> None:
        self.kill_children()
        deadline = time.monotonic() + self.cancel_grace_s
        while time.monotonic() < deadline:
            if handled.wait(0.05) or self.finished.is_set():
                return
        error = self._failure
        assert error is not None
        log.error("the main thread did not stop within %.1f s; exiting now", self.cancel_grace_s)
        if self._last_words is not None:
            try:
                self._last_words(error)
            except Exception:  # last resort path: nothing more to do than log
                log.exception("could not publish the final heartbeat")
        os._exit(int(error.exit_code))

    def check(self) -> None:
        """Raise a stop request or the recorded failure (in the main thread)."""
        raise_if_interrupted()
        if self._failure is not None:
            raise self._failure

    def check_cancel(self) -> None:
        """For actions: raise Cancelled once the group is stopping."""
        if self.cancel.is_set():
            raise Cancelled(str(self._failure) if self._failure else "cancelled")


# A stop request can arrive twice at once: on `scancel`, slurmstepd signals
# every process of the step and srun forwards the same signal to it again.
# Within this window a second signal is that same request, not an impatient
# operator asking to kill at once.
DUPLICATE_SIGNAL_WINDOW_S: Final = 2.0


# The signal of the first stop request, kept: the Interrupted its handler raises
# can land where it is swallowed (inside a log record's write, whose errors
# logging reports and drops), and the daemon must still stop as asked.
_REQUESTED: list[int] = []


def pending_interrupt() -> Interrupted | None:
    """Interrupted, once SIGTERM or SIGINT has asked this process to stop."""
    return Interrupted(_REQUESTED[0]) if _REQUESTED else None


def raise_if_interrupted() -> None:
    if (stop := pending_interrupt()) is not None:
        raise stop


def install_signal_handlers(*, clock: Callable[[], float] = time.monotonic) -> None:
    """SIGTERM and SIGINT raise Interrupted in the main thread, and every later
    `Runtime.check` raises it again; a second signal, once
    DUPLICATE_SIGNAL_WINDOW_S have passed, kills at once."""
    first: list[float] = []
    _REQUESTED.clear()

    def handler(signum: int, frame: FrameType | None) -> None:
        if not first:
            first.append(clock())
            _REQUESTED.append(signum)
            raise Interrupted(signum)
        if clock() - first[0] < DUPLICATE_SIGNAL_WINDOW_S:
            return  # the same request, delivered twice
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
