"""Phase 10 on a split node: training and the next iteration's rollout at once.

A node that run.train_nodes and run.rollout_nodes both name, by disjoint GPU
ranges (rl/placement.py), trains iteration N on its train GPUs while
its engine, on its rollout GPUs, rolls out its shard of N+1.  Training runs in
the phase's own thread; the rollout in a thread of its own, with a context
whose cancel check also stops it when training fails.  The phase ends when
both have: it fails with the first error, and never leaves the rollout
writing behind it (the rank's manifest has one writer).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from coordinator.errors import Cancelled
from coordinator.machine.actions import StepContext
from rl.loop import Loop

log = logging.getLogger(__name__)
# After training failed: how long the rollout may take to finish its groups in
# flight and stop.  A group is seconds to a few minutes of generation.
STOP_TIMEOUT_S: Final = 300.0
POLL_S: Final = 0.2


@dataclass(kw_only=True)
class _AheadContext(StepContext):
    stop: threading.Event

    def check_cancel(self) -> None:
        if self.stop.is_set():
            raise Cancelled("this node's training failed: its rollout ahead stops")
        super().check_cancel()


class RolloutAhead:
    """The next iteration's rollout in a thread; `result()` waits for it."""

    def __init__(self, loop: Loop, ctx: StepContext) -> None:
        from rl.rollouts import roll_out_next

        fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)}
        self.ctx = _AheadContext(**fields, stop=threading.Event())
        self._result: dict[str, Any] | None = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._result = dict(roll_out_next(loop, self.ctx))
            except BaseException as exc:  # handed to the phase's thread by result()
                self._error = exc

        self.thread = threading.Thread(target=run, name=f"rollout-ahead-{ctx.iteration + 1}",
                                       daemon=True)
        self.thread.start()

    def result(self, check_cancel: Callable[[], None]) -> dict[str, Any]:
        """The rollout's arrival payload once it is done; its error, raised here."""
        while self.thread.is_alive():
            try:
                check_cancel()  # the group stopping: stop the rollout too
            except BaseException:
                self.stop()
                raise
            self.thread.join(POLL_S)
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def stop(self) -> None:
        """Stop between groups and wait for the thread (at most STOP_TIMEOUT_S); the
        caller then raises its own error."""
        self.ctx.stop.set()
        started = time.monotonic()
        self.thread.join(STOP_TIMEOUT_S)
        if self.thread.is_alive():
            log.error("the rollout of iteration %d did not stop within %.0f s; it ends when "
                      "the engine is stopped with the daemon's children", self.ctx.iteration + 1,
                      STOP_TIMEOUT_S)
        else:
            log.info("the rollout of iteration %d stopped %.1f s after the phase failed",
                     self.ctx.iteration + 1, time.monotonic() - started)


def train_alongside(loop: Loop, ctx: StepContext,
                    train: Callable[[], Mapping[str, Any]]) -> Mapping[str, Any]:
    """`train()` with the next iteration's rollout alongside (a split node's phase 10)."""
    ahead = RolloutAhead(loop, ctx)
    try:
        done = train()
    except BaseException:
        ahead.stop()
        raise
    return {**done, "next_rollout": ahead.result(ctx.check_cancel)}
