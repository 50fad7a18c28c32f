"""The per-node daemon: join the group, run the phases, stop cleanly.

    start ─► resolve run (master: run.json) ─► claim rank ─► heartbeat
          ─► join (workers: find the master; master: wait for all, publish session)
          ─► for each iteration, for each phase (coordinator/machine/stepper.py):
                 action (skipped if the journal says done) ─► journal
                 ─► arrive ─► master: collect, decide, release | worker: wait release
          ─► finished (claim removed, heartbeat says finished)

The decisions along the way are pure functions (coordinator/machine/decisions.py);
this module owns the daemon's lifecycle and its threads.

    wait                        | waits for                     | released by
    ----------------------------+-------------------------------+---------------------------
    worker: find the master     | run.json + live rank-0 beat    | master start
    master: gather members      | claim + live beat of each rank | every worker start
    worker: session             | session.json naming its token  | master, all joined
    master: barrier (N, K)      | arrival of every rank          | each rank's action
    worker: barrier (N, K)      | release (N, K)                 | master's decision
    every wait, in background   | peers' heartbeats (leases)     | -

Any failure anywhere goes through `Runtime.fail`, which cancels the action,
kills the children and, on the master, puts an abort in the heartbeat so that
every worker stops too.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Mapping
from typing import Any

from coordinator.config.on_failure import policy
from coordinator.errors import (
    Cancelled,
    CoordinatorError,
    ExitCode,
    FencedError,
    Interrupted,
    RunCompleted,
    storage_error,
)
from coordinator.machine import finished, membership, netaddr, regroup
from coordinator.machine.actions import Actions, StepContext, completed_run, kind
from coordinator.machine.barrier import Barrier
from coordinator.machine.decisions import Membership, abort_of
from coordinator.machine.group import GroupForming
from coordinator.machine.journal import JournalBook
from coordinator.machine.liveness import HeartbeatPublisher, Monitor, session_monitor
from coordinator.machine.polling import Backoff, Clock
from coordinator.machine.runplan import RunPlan
from coordinator.machine.runtime import Runtime, install_signal_handlers, pending_interrupt
from coordinator.machine.stepper import PhaseStepper
from coordinator.records import layout
from coordinator.records.phases import Phase
from coordinator.records.records import (
    Claim,
    Heartbeat,
    NodeState,
    Session,
)
from coordinator.storage import fsio
from coordinator.storage.store import FsStore, publish_record
from coordinator.storage.waker import Waker

log = logging.getLogger("coordinator")
# The last phase's release names the ranks a shrunk group takes back before the
# next iteration (docs/PROTOCOL.md, "Going on with fewer nodes").
ADMIT = "admit"


class Daemon:
    def __init__(self, plan: RunPlan, *, clock: Clock | None = None) -> None:
        self.plan = plan
        self.rank = plan.rank
        self.is_master = plan.rank == 0
        self.manifest = plan.manifest
        self.config = plan.config
        self.coord = plan.config.coordination
        fsio.set_read_retry(self.coord.read_retry_s)  # the actions' reads follow it too
        self.store = FsStore(plan.run_dir)
        self.clock = clock or Clock()
        self.token = secrets.token_hex(8)
        self.host = membership.hostname()
        self.runtime = Runtime(cancel_grace_s=self.coord.cancel_grace_s)
        self.backoff = Backoff(initial_s=self.coord.poll_initial_s, factor=self.coord.poll_factor,
                               ceiling_s=self.coord.poll_ceiling_s)
        self.phases = kind(self.config.run.actions).phases_of(self.config)
        self.heartbeat: HeartbeatPublisher | None = None
        self.monitor: Monitor | None = None
        self.probe_server: netaddr.ProbeServer | None = None
        self.waker: Waker | None = None
        self.actions: Actions | None = None
        self.session: Session | None = None
        self.address = plan.address
        self.journal = JournalBook(self.store, run_id=self.manifest.run_id, rank=self.rank,
                                   retry_s=self.coord.read_retry_s)
        # Automatic recoveries (regroup.py): the master counts the run's, from
        # recoveries.json; a worker the ones of this process.
        self.history = regroup.RecoveryLog(run_id=self.manifest.run_id, recoveries=())
        self.recoveries = 0
        # Master: the last heartbeat of the incarnation this one replaces, when it
        # did not stop cleanly (a restart after a loss: recorded as a recovery).
        self.previous_master: Heartbeat | None = None
        self.group: GroupForming | None = None
        self.timings: dict[str, dict[str, float]] = {}  # of the current iteration

    # -- lifecycle ------------------------------------------------------------
    def run(self) -> ExitCode:
        install_signal_handlers()
        try:
            try:
                self._start()
                self._run_sessions()
            except RunCompleted as exc:
                # Complete before this start (the master's journal), or while this
                # rank waited to join or to be taken back.
                log.info("rank %d: %s", self.rank, exc)
            summary = self._summary()
            self._finish(NodeState.FINISHED, None)
            log.info("rank %d finished %s", self.rank, summary)
            return ExitCode.OK
        except CoordinatorError as exc:
            return self._stop(self._cause(exc))
        except OSError as exc:
            storage = storage_error(exc)
            if storage is None:
                raise
            return self._stop(storage)
        except Exception as exc:
            log.exception("rank %d: unexpected error", self.rank)
            return self._stop(CoordinatorError(f"internal error: {exc!r}"))
        finally:
            self.runtime.finished.set()
            fsio.STATS.dump_for_benchmark(self.rank)

    def _summary(self) -> str:
        recoveries = len(regroup.read_log(self.store, self.manifest.run_id,
                                          retry_s=self.coord.read_retry_s).recoveries)
        return completed_run(kind(self.config.run.actions), self.plan.run_dir, self.config,
                             run_id=self.manifest.run_id, recoveries=recoveries,
                             last_phase=self.phases[-1])

    def _stop(self, error: CoordinatorError) -> ExitCode:
        state = NodeState.LEFT if isinstance(error, Interrupted) else NodeState.FAILED
        self.runtime.fail(error)
        self.runtime.in_hand()
        self._finish(state, str(error))
        log.error("rank %d stops: %s", self.rank, error)
        return error.exit_code

    def _cause(self, exc: CoordinatorError) -> CoordinatorError:
        """What stops this session: the recorded failure when `exc` is its consequence."""
        failure = self.runtime.failure
        return failure if isinstance(exc, Cancelled) and failure is not None else exc

    def _run_sessions(self) -> None:
        """Sessions until the run is done: after a recoverable failure the group
        re-forms (regroup.py); a shrunk group takes back ranks between iterations."""
        while True:
            try:
                if not self._run_session():
                    return
                self._take_back()
            except CoordinatorError as exc:
                self.runtime.in_hand()
                # A stop request first: its own raise may have been lost (runtime.py).
                error = pending_interrupt() or self._cause(exc)
                repeated = self._repeated(error)
                if repeated is not None:
                    raise repeated from exc
                if not self._regroups_after(error):
                    raise error from exc if error is not exc else None
                self._regroup(error)

    def _run_session(self) -> bool:
        """Run this session's iterations; True when it ended early, at an iteration
        boundary, to take back ranks that returned to a shrunk group."""
        assert self.session is not None
        if self.session.start_iteration >= self.session.end_iteration:
            log.info("run %s is already complete (%d iterations); nothing to do",
                     self.manifest.run_id, self.session.end_iteration)
            return False
        return self._loop()

    def _regroups_after(self, error: CoordinatorError) -> bool:
        return regroup.recoverable(error, self.coord, recoveries=self.recoveries) and \
            self._repeated(error) is None

    def _repeated(self, error: CoordinatorError) -> CoordinatorError | None:
        """Master: the error that stops the run when `error` is one step failing the
        same way for the coordination.max_attempts-th time (regroup.py); the workers
        then exit with it, the master having stopped for good."""
        if not self.is_master or self.heartbeat is None or \
                not policy(self.coord.on_failure).regroups:
            return None
        incident = regroup.Incident.of(error, by=self.rank, where=self.heartbeat.record)
        return regroup.repeated_failure(self.history, incident,
                                        max_attempts=self.coord.max_attempts)

    def _regroup(self, error: CoordinatorError) -> None:
        """Stop this session's work and wait for the group to re-form (regroup.py)."""
        assert self.heartbeat is not None
        started = time.monotonic()
        incident = regroup.Incident.of(error, by=self.rank, where=self.heartbeat.record)
        self.runtime.fail(error)  # peers learn it now, if nobody published it yet
        # The monitor first: still running, it would record the same failure again
        # after resume() cleared it, and the wait for the next session would raise it.
        if self.monitor is not None:
            self.monitor.stop()
        self.runtime.resume()
        self.runtime.kill_children()
        self._close_actions()
        self.recoveries += 1
        log.warning("rank %d: %s; stopped this rank's work, waiting up to %.0f s for the group "
                    "to re-form", self.rank, error, self.coord.rejoin_timeout_s)
        left = self._leave_session(
            error=str(error)[:regroup.MAX_CAUSE_CHARS], fault=self._own_fault(error),
            waiting_for="the group to re-form after a failure (coordination.on_failure)")
        if self.is_master:
            self._form_session(incident=incident, started=started)
        else:
            self._rejoin(left)
        self._build_actions()

    def _take_back(self) -> None:
        """Between two iterations of a shrunk group: a new session with the ranks that
        returned (regroup.py).  No failure: engines and actions stay as they are.

        The master's heartbeat stays in the old session until the new one is formed:
        a member still finishing the iteration reads the last release from it, and
        its monitor has no reason to take the master for gone."""
        assert self.heartbeat is not None
        if not self.is_master:
            self._rejoin(self._leave_session(
                error=None,
                waiting_for="the group to take back the ranks that returned, between iterations"))
            return
        if self.monitor is not None:
            self.monitor.stop()
        self.heartbeat.set(waiting_for="the members and the ranks that returned, to form the "
                           "next session")
        self._form_session(admit=True)

    def _leave_session(self, *, error: str | None, waiting_for: str, fault: str = "") -> str:
        """Out of this session (heartbeat regrouping, session null: the master may form
        the next one with this rank, membership.gather_members); returns its id.
        `fault`: the signature of this rank's own failed step, kept in the heartbeat."""
        assert self.heartbeat is not None and self.session is not None
        if self.monitor is not None:
            self.monitor.stop()
        self.heartbeat.update(state=NodeState.REGROUPING, error=error, fault=fault, session=None,
                              arrived=None, released=None, waiting_for=waiting_for,
                              resume_iteration=self.journal.resume_iteration)
        return self.session.session

    def _rejoin(self, left: str) -> None:
        """Worker: the next session, from the same master or a restarted one."""
        assert self.group is not None
        session, master_host = self.group.rejoin(left, self.membership.members[0])
        self._enter_session(session, {0: master_host})

    def _start(self) -> None:
        run_id, generation = self.manifest.run_id, self.manifest.generation
        master_info = self.plan.master
        if self.is_master:
            self.probe_server = netaddr.ProbeServer(self.address)
            self.history = regroup.read_log(self.store, run_id, retry_s=self.coord.read_retry_s)
            self.recoveries = len(self.history.recoveries)
        claim = Claim(
            run_id=run_id, generation=generation, rank=self.rank, token=self.token,
            host=self.host, address=self.address,
            probe_port=self.probe_server.port if self.probe_server else None,
            pid=os.getpid(), started=time.time(),
        )
        membership.claim_rank(
            self.store, claim, lease_s=self.coord.lease_s, clock=self.clock,
            retry_s=self.coord.read_retry_s, backoff=self.backoff,
            progress_interval_s=self.coord.progress_interval_s,
        )
        if self.is_master:  # read before our first beat replaces it
            self.previous_master = membership.unfinished_master(
                self.store, run_id, retry_s=self.coord.read_retry_s)
        if self.plan.republish is not None:
            # Only the holder of rank 0 writes run.json (one writer per file).
            publish_record(self.store, layout.MANIFEST, self.plan.republish)
        self.heartbeat = HeartbeatPublisher.starting(
            self.store, claim, resume_iteration=self.journal.resume_iteration,
            interval_s=self.coord.heartbeat_interval_s, runtime=self.runtime,
            retry_s=self.coord.read_retry_s)
        self.heartbeat.start()
        self.runtime.on_fail(self._publish_failure)
        self.runtime.on_last_words(lambda e: self._final_heartbeat(NodeState.FAILED, str(e)))
        log.info("rank %d joined run %s generation %d as pid %d on %s (%s)", self.rank, run_id,
                 generation, os.getpid(), self.host, self.address)
        if self.is_master and finished.complete(self.journal.resume_iteration,
                                                self.config.run.iterations):
            # Before any wait: workers started again on it would never come
            # (coordinator/machine/finished.py), and a requeue would hold every node.
            raise RunCompleted(finished.master_message(run_id, self.config.run.iterations))
        self.group = GroupForming(
            store=self.store, manifest=self.manifest, coord=self.coord, rank=self.rank,
            token=self.token, host=self.host, run_dir=self.plan.run_dir,
            phases=self.phases, iterations=self.config.run.iterations,
            heartbeat=self.heartbeat, runtime=self.runtime, backoff=self.backoff,
            clock=self.clock)
        if self.is_master:
            self._form_session()
        else:
            assert master_info is not None
            session = self.group.await_first(master_info.claim)
            self._enter_session(session, {0: master_info.claim.host})
        # Each wait watches exactly the heartbeats it polls (a worker: the
        # master's; the master: the missing ranks'), so the inotify traffic a
        # worker sees does not grow with the node count.
        if self.coord.wakeups:
            self.waker = Waker.for_run_dir(self.plan.run_dir)
            # A wait that polls only at the ceiling must still stop at once
            # when a peer is lost or a signal arrives.
            wake = self.waker.event
            self.runtime.on_fail(lambda _error: wake.set())
        self._build_actions()

    def _build_actions(self) -> None:
        self.actions = kind(self.config.run.actions).build(
            self.config, rank=self.rank, num_nodes=self.manifest.num_nodes,
            run_dir=self.plan.run_dir)

    def _close_actions(self) -> None:
        if self.actions is not None:
            try:
                self.actions.close()
            except Exception:  # stopping path: log and go on
                log.exception("closing the actions failed")
            self.actions = None

    def _form_session(self, *, incident: regroup.Incident | None = None,
                      started: float | None = None, admit: bool = False) -> None:
        """Master: see group.py; a restart of a lost master is recorded as a recovery."""
        assert self.group is not None
        session, hosts, self.history = self.group.form(
            self.history, incident=incident, started=started, previous=self.previous_master,
            admit=admit)
        self.previous_master = None
        self._enter_session(session, hosts)

    def _enter_session(self, session: Session, hosts: Mapping[int, str]) -> None:
        assert self.heartbeat is not None
        self.session = session
        self.journal.skip_to(session.start_iteration)
        self.heartbeat.set(resume_iteration=self.journal.resume_iteration)
        self.membership = Membership.of(session, rank=self.rank, token=self.token, hosts=hosts)
        self.monitor = session_monitor(
            self.store, self.runtime, self.coord, rank=self.rank, run_id=self.manifest.run_id,
            generation=self.manifest.generation, members=self.membership.members, hosts=hosts,
            clock=self.clock)

    # -- the phases -----------------------------------------------------------
    def _loop(self) -> bool:
        assert self.session is not None and self.heartbeat and self.monitor
        self.barrier = Barrier(
            self.store, self.membership, heartbeat=self.heartbeat, monitor=self.monitor,
            runtime=self.runtime, backoff=self.backoff,
            progress_interval_s=self.coord.progress_interval_s,
            retry_s=self.coord.read_retry_s, clock=self.clock, waker=self.waker,
            heartbeat_path=lambda r: self.store.path(layout.heartbeat(r)),
            failure_state=NodeState.REGROUPING if regroup.regroups(
                self.coord, recoveries=self.recoveries) else NodeState.FAILED,
        )
        assert self.actions is not None
        stepper = PhaseStepper(
            rank=self.rank, host=self.host, run_dir=self.plan.run_dir, actions=self.actions,
            barrier=self.barrier, heartbeat=self.heartbeat, runtime=self.runtime,
            journal=self.journal, timeouts=self.coord.phase_timeouts_s, phases=self.phases,
            context=self._context, monitor=self.monitor, lease_s=self.coord.lease_s,
            beat_s=self.coord.heartbeat_interval_s, extra_release=self._admission,
        )
        for iteration in range(self.session.start_iteration, self.session.end_iteration):
            self.timings = {}  # what actions see of the phases passed (StepContext)
            releases = stepper.iteration(iteration, store=self.store,
                                         run_id=self.manifest.run_id, timings=self.timings)
            admit = releases.get(int(self.phases[-1]), {}).get(ADMIT)
            if admit and iteration + 1 < self.session.end_iteration:
                log.info("rank %d: the group takes back rank(s) %s before iteration %d",
                         self.rank, admit, iteration + 1)
                return True
        return False

    def _admission(self, iteration: int, phase: Phase) -> dict[str, Any]:
        """Master, the last phase's release: ranks that returned to a shrunk group."""
        assert self.session is not None and self.group is not None
        if phase != self.phases[-1] or iteration + 1 >= self.session.end_iteration:
            return {}
        back = self.group.returning(self.session)
        return {ADMIT: back} if back else {}

    def _context(self, iteration: int, phase: Phase,
                 releases: dict[int, Mapping[str, Any]]) -> StepContext:
        return StepContext(
            rank=self.rank, num_nodes=self.manifest.num_nodes, iteration=iteration, phase=phase,
            run_dir=self.plan.run_dir, run_id=self.manifest.run_id, config=self.config,
            weights=self.manifest.rank_weights, host=self.host, address=self.address,
            runtime=self.runtime, releases=releases, timings=self.timings,
            members=None if len(self.membership.members) == self.manifest.num_nodes
            else tuple(sorted(self.membership.members)),
        )

    # -- failure, shutdown -------------------------------------------------------
    def _own_fault(self, error: CoordinatorError) -> str:
        """The signature of `error` when it is this rank's own failed step, else "": in
        the heartbeat, so that a master that sees it before the failed arrival (or
        regrouping) still knows which fault it was (regroup.repeated_failure)."""
        return regroup.fault_of(error) if getattr(error, "rank", None) == self.rank else ""

    def _publish_failure(self, error: CoordinatorError) -> None:
        """Runtime hook: let peers know at once (the master's abort stops every worker)."""
        if self.heartbeat is None:
            return
        state = NodeState.LEFT if isinstance(error, Interrupted) else \
            NodeState.REGROUPING if self._regroups_after(error) else NodeState.FAILED
        changes: dict[str, Any] = {"state": state, "error": str(error),
                                   "fault": self._own_fault(error)}
        hb = self.heartbeat.record
        if self.is_master and hb.abort is None:
            changes["abort"] = abort_of(error, iteration=hb.iteration, phase=hb.phase)
        try:
            self.heartbeat.update(**changes)
        except (OSError, CoordinatorError) as exc:
            log.error("could not publish the failure: %s", exc)

    def _final_heartbeat(self, state: NodeState, error: str | None) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop(state=state, error=error, waiting_for="")

    def _finish(self, state: NodeState, error: str | None) -> None:
        if self.monitor is not None:
            self.monitor.stop()
        self._close_actions()
        self.runtime.kill_children()
        self._final_heartbeat(state, error)
        if self.heartbeat is not None and not isinstance(self.runtime.failure, FencedError):
            membership.release_claim(self.store, self.rank, self.token,
                                     retry_s=self.coord.read_retry_s)
        if self.waker is not None:
            self.waker.close()
        if self.probe_server is not None:
            self.probe_server.close()
