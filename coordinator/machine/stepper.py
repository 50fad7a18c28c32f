"""One phase on one rank: act, arrive, wait, apply.

    plan   decisions.step_action: run the action, or skip it (journal, collective flag)
    act    actions.run(phase, ctx); its outcome becomes the arrival's status
    arrive publish arrive-<R>.json (the barrier announces it in the heartbeat)
    wait   worker: the master's release; master: every arrival, judged by
           decisions.judge_arrivals, then actions.decide + the collective flags
    apply  the release payload joins this iteration's releases

A collective step (training) fails on every node when one node dies: torchrun
on the survivors loses its peer.  So a failure there is not reported at once:
the failing worker waits for the master's verdict, and the master first
gives every peer's heartbeat the time to prove it alive (at most one lease).
If a peer is lost meanwhile, the abort names that peer (exit 3 everywhere),
not the survivors whose training broke because of it.

Every decision is a pure function of coordinator/machine/decisions.py; this module
does the calls and the I/O around them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from coordinator.config.run_config import PhaseTimeouts
from coordinator.errors import (
    Cancelled,
    FencedError,
    Interrupted,
    MalformedRecordError,
    PeerLostError,
    PhaseFailedError,
    StorageError,
    UsageError,
    WaitTimeout,
    storage_error,
)
from coordinator.machine.actions import Actions, StepContext
from coordinator.machine.barrier import Barrier
from coordinator.machine.decisions import (
    RunFlags,
    StepAction,
    abort_of,
    collective_flags,
    rerun_phases,
    step_action,
)
from coordinator.machine.journal import JournalBook
from coordinator.machine.liveness import HeartbeatPublisher, Monitor
from coordinator.machine.runtime import Runtime
from coordinator.records import layout
from coordinator.records.phases import Phase, spec
from coordinator.records.records import ArrivalStatus, NodeState
from coordinator.storage.store import Store

log = logging.getLogger("coordinator")

# Raised through an action untouched: they already say what stops the daemon.
# Not a failed step: the daemon stops (a usage error: settings that cannot work,
# which no retry cures, exit 2 on every node).
_STOPPING = (PeerLostError, FencedError, Interrupted, WaitTimeout, StorageError,
             MalformedRecordError, UsageError)


class PhaseStepper:
    def __init__(
        self, *, rank: int, host: str, run_dir: Path, actions: Actions, barrier: Barrier,
        heartbeat: HeartbeatPublisher, runtime: Runtime, journal: JournalBook,
        timeouts: PhaseTimeouts, phases: Sequence[Phase],
        context: Callable[[int, Phase, dict[int, Mapping[str, Any]]], StepContext],
        monitor: Monitor, lease_s: float, beat_s: float,
        extra_release: Callable[[int, Phase], Mapping[str, Any]] | None = None,
    ) -> None:
        self.rank = rank
        self.is_master = rank == 0
        self.host = host
        self.run_dir = run_dir
        self.actions = actions
        self.barrier = barrier
        self.heartbeat = heartbeat
        self.runtime = runtime
        self.journal = journal
        self.timeouts = timeouts
        self.phases = tuple(phases)
        self.context = context
        self.monitor = monitor
        self.lease_s, self.beat_s = lease_s, beat_s
        # Master: what the daemon adds to a release (ranks a shrunk group takes back).
        self.extra_release = extra_release

    def iteration(self, iteration: int, *, store: Store, run_id: str,
                  timings: dict[str, dict[str, float]]) -> dict[int, Mapping[str, Any]]:
        """Every phase of `iteration` on this rank, then its journal entry, the
        heartbeat's resume point and the iteration's timings (filled into `timings`,
        which the actions see); returns the phases' releases."""
        releases: dict[int, Mapping[str, Any]] = {}
        started = time.monotonic()
        for phase in self.phases:
            timings[str(int(phase))] = self.step(iteration, phase, releases)
        self.journal.complete(iteration)
        # A group re-formed after a failure starts where its members' journals say.
        self.heartbeat.set(resume_iteration=self.journal.resume_iteration)
        total = time.monotonic() - started
        publish_timings(store, run_id=run_id, iteration=iteration, rank=self.rank,
                        phases=timings, total_s=total)
        log.info("rank %d completed iteration %d in %.2f s", self.rank, iteration, total)
        return releases

    def step(self, iteration: int, phase: Phase,
             releases: dict[int, Mapping[str, Any]]) -> dict[str, float]:
        """One phase on this rank; returns its timings (action, barrier wait)."""
        plan = self._plan(iteration, phase, releases)
        self.runtime.check()
        # Not published on its own: the heartbeat thread carries the new phase
        # within one interval, and the arrival publishes it at once.  Saving
        # this publish (two fsyncs) per phase matters with many ranks on one
        # filesystem.
        self.heartbeat.set(state=NodeState.RUNNING, iteration=iteration, phase=int(phase),
                           waiting_for="")
        ctx = self.context(iteration, phase, releases)
        action_started = time.monotonic()
        status, error, payload = self._act(plan, iteration, phase, ctx)
        wait_started = time.monotonic()
        collective = spec(phase).collective
        arrival = self.barrier.arrive(iteration, phase, status=status, error=error,
                                      done=self.journal.done_phases(iteration), payload=payload,
                                      awaits_verdict=collective)
        arrived_at = time.time()
        deadline = self.timeouts.of(spec(phase).timeout)
        if self.is_master:
            release_payload = self._release(iteration, phase, ctx, arrival, deadline)
        else:
            if status is ArrivalStatus.FAILED and not collective:
                raise PhaseFailedError(
                    f"rank {self.rank} failed iteration {iteration} {phase.label}: {error}",
                    rank=self.rank, iteration=iteration, phase=int(phase), cause=error or "")
            release_payload = self.barrier.wait_release(iteration, phase,
                                                        deadline_s=deadline).payload
        releases[int(phase)] = release_payload
        polls = self.barrier.last_wait.polls if self.barrier.last_wait else 0
        # Wall times let a benchmark on one machine compute release latency
        # (last arrival to last release) across ranks.
        return {"action_s": wait_started - action_started,
                "wait_s": time.monotonic() - wait_started, "polls": float(polls),
                "arrived_at": arrived_at, "released_at": time.time()}

    # -- plan and act ------------------------------------------------------------
    def _plan(self, iteration: int, phase: Phase,
              releases: Mapping[int, Mapping[str, Any]]) -> StepAction:
        collective = spec(phase).collective
        run_flag = None
        if collective:
            where = self.run_dir / layout.release(iteration, max(int(phase) - 1, 0))
            run_flag = RunFlags.of(releases.get(int(phase) - 1, {}), where).runs(phase)
        rerun = int(phase) in rerun_phases(releases, self.run_dir / layout.iteration_dir(
            iteration))
        return step_action(collective=collective,
                           journal_done=self.journal.is_done(iteration, phase),
                           run_flag=run_flag, rerun=rerun)

    def _act(self, plan: StepAction, iteration: int, phase: Phase,
             ctx: StepContext) -> tuple[ArrivalStatus, str | None, dict[str, Any]]:
        if plan is StepAction.SKIP_DONE:
            log.info("rank %d iteration %d %s: already done (journal), not redone", self.rank,
                     iteration, phase.label)
            return ArrivalStatus.OK, None, {}
        if plan is StepAction.SKIP_COLLECTIVE:
            log.info("rank %d iteration %d %s: every rank completed it before, not rerun",
                     self.rank, iteration, phase.label)
            return ArrivalStatus.OK, None, {}
        log.debug("rank %d iteration %d %s: action", self.rank, iteration, phase.label)
        try:
            payload = dict(self.actions.run(phase, ctx))
        except Cancelled:
            self.runtime.check()
            raise
        except _STOPPING:
            raise
        except Exception as exc:
            # The group is stopping (a peer was lost, a signal came): the
            # action's error is a consequence, the recorded failure the cause.
            self.runtime.check()
            # A full or read-only shared filesystem fails this rank's writes
            # and its heartbeat alike: say so, not a phase failure nobody can
            # publish.
            storage = storage_error(exc)
            if storage is not None:
                raise storage from exc
            log.exception("rank %d iteration %d %s failed", self.rank, iteration, phase.label)
            return ArrivalStatus.FAILED, f"{type(exc).__name__}: {exc}", {}
        self.journal.mark_done(iteration, phase)
        return ArrivalStatus.OK, None, payload

    # -- the master's side of the barrier -----------------------------------------
    def _release(self, iteration: int, phase: Phase, ctx: StepContext, arrival: Any,
                 deadline: float) -> Mapping[str, Any]:
        try:
            if arrival.status is ArrivalStatus.FAILED:
                raise PhaseFailedError(
                    f"rank 0 (the master, host {self.host}) failed iteration {iteration} "
                    f"{phase.label}: {arrival.error}",
                    rank=0, iteration=iteration, phase=int(phase), cause=arrival.error or "")
            arrivals = self.barrier.collect(iteration, phase, own=arrival, deadline_s=deadline)
            payload = dict(self.actions.decide(phase, ctx, arrivals))
            flags = collective_flags(self.phases, phase, arrivals)
            if flags is not None:
                payload["run"] = flags.run
            if self.extra_release is not None:
                payload.update(self.extra_release(iteration, phase))
        except Exception as exc:
            cause = self._attribute(phase, exc)
            self._abort(iteration, phase, cause)
            if cause is exc:
                raise
            raise cause from exc
        return self.barrier.release(iteration, phase, payload).payload

    def _attribute(self, phase: Phase, failure: BaseException) -> BaseException:
        """The cause to report for a failure: in a collective phase, a peer lost within
        one lease is the cause, not the failed step it took down with it."""
        if not spec(phase).collective or not isinstance(failure, PhaseFailedError):
            return failure
        started = self.monitor.clock()
        deadline = started + self.lease_s + self.beat_s
        log.info("a collective step failed (%s); checking every peer's heartbeat before "
                 "blaming it (at most %.1f s)", failure, deadline - started)
        while self.monitor.clock() < deadline:
            if isinstance(self.runtime.failure, PeerLostError):
                return self.runtime.failure
            if self.monitor.all_beat_since(started):
                return failure  # every peer lives: the step itself failed
            self.runtime.cancel.wait(0.05)
        return self.runtime.failure if isinstance(self.runtime.failure, PeerLostError) \
            else failure

    def _abort(self, iteration: int, phase: Phase, exc: BaseException) -> None:
        if isinstance(exc, Cancelled) and self.runtime.failure is not None:
            exc = self.runtime.failure  # what cancelled the decision is the cause
        abort = abort_of(exc, iteration=iteration, phase=int(phase))
        try:
            self.barrier.abort(iteration, phase, abort)
        except Exception as err:  # shutdown path: the daemon exits with the cause anyway
            log.error("could not publish the abort: %s", err)


def publish_timings(store: Store, *, run_id: str, iteration: int, rank: int,
                    phases: Mapping[str, Mapping[str, float]], total_s: float) -> None:
    """iterations/<N>/timings/rank-<R>.json: what each phase of the iteration cost."""
    body = {"schema": "coordinator/timings", "version": 1, "run_id": run_id,
            "iteration": iteration, "rank": rank, "total_s": total_s, "phases": phases}
    store.publish(layout.timings(iteration, rank), json.dumps(body).encode())
