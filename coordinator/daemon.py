"""The per-node daemon: join the group, run the phases, stop cleanly.

    start ─► resolve run (master: run.json) ─► claim rank ─► heartbeat
          ─► join (workers: find the master; master: wait for all, publish session)
          ─► for each iteration, for each phase:
                 action (skipped if the journal says done) ─► journal
                 ─► arrive ─► master: collect, decide, release | worker: wait release
          ─► finished (claim removed, heartbeat says finished)

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

import dataclasses
import json
import logging
import os
import secrets
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from coordinator import layout, membership, netaddr
from coordinator.actions import Actions, StepContext, kind
from coordinator.barrier import Barrier, Membership
from coordinator.config import RunConfig
from coordinator.errors import (
    Cancelled,
    CoordinatorError,
    ExitCode,
    FencedError,
    Interrupted,
    MalformedRecordError,
    PeerLostError,
    PhaseFailedError,
    StorageError,
    WaitTimeout,
    storage_error,
)
from coordinator.liveness import HeartbeatPublisher, Monitor, PeerTracker, fence_check
from coordinator.phases import Phase, RlPhase, should_eval, spec
from coordinator.polling import Backoff, Clock
from coordinator.records import (
    Abort,
    AbortKind,
    ArrivalStatus,
    Claim,
    Heartbeat,
    Journal,
    Manifest,
    NodeState,
    Session,
)
from coordinator.runtime import Runtime
from coordinator.store import FsStore, publish_record, read_record
from coordinator.waker import LOCAL_FILESYSTEMS, Waker, filesystem_type

log = logging.getLogger("coordinator")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunPlan:
    """What this daemon was asked to do, after CLI validation and run resolution."""

    log_path: Path
    rank: int
    manifest: Manifest
    config: RunConfig
    address: str = "127.0.0.1"  # this host's address, checked at the CLI boundary
    # Workers: the live master found before the plan was made (runplan.py).
    master: membership.MasterInfo | None = None
    # Master: run.json to republish once rank 0 is held (operational keys changed).
    republish: Manifest | None = None


class Daemon:
    def __init__(self, plan: RunPlan, *, clock: Clock | None = None) -> None:
        self.plan = plan
        self.rank = plan.rank
        self.is_master = plan.rank == 0
        self.manifest = plan.manifest
        self.config = plan.config
        self.coord = plan.config.coordination
        self.store = FsStore(plan.log_path)
        self.clock = clock or Clock()
        self.token = secrets.token_hex(8)
        self.host = membership.hostname()
        self.runtime = Runtime(cancel_grace_s=self.coord.cancel_grace_s)
        self.backoff = Backoff(initial_s=self.coord.poll_initial_s, factor=self.coord.poll_factor,
                               ceiling_s=self.coord.poll_ceiling_s)
        self.phases = RlPhase(self.config.run.rl_phase).phases
        self.heartbeat: HeartbeatPublisher | None = None
        self.monitor: Monitor | None = None
        self.probe_server: netaddr.ProbeServer | None = None
        self.waker: Waker | None = None
        self.actions: Actions | None = None
        self.session: Session | None = None
        self.address = plan.address
        self.listener: netaddr.Listener | None = None  # master: the training port, held
        self.journal = self._load_journal()

    # -- lifecycle ------------------------------------------------------------
    def run(self) -> ExitCode:
        self._install_signals()
        try:
            self._start()
            assert self.session is not None
            if self.session.start_iteration >= self.session.end_iteration:
                log.info("run %s is already complete (%d iterations); nothing to do",
                         self.manifest.run_id, self.session.end_iteration)
            else:
                self._loop()
            self._finish(NodeState.FINISHED, None)
            log.info("rank %d finished run %s", self.rank, self.manifest.run_id)
            return ExitCode.OK
        except CoordinatorError as exc:
            error = self.runtime.failure if isinstance(exc, Cancelled) and self.runtime.failure else exc
            state = NodeState.LEFT if isinstance(error, Interrupted) else NodeState.FAILED
            self.runtime.fail(error)
            self._finish(state, str(error))
            log.error("rank %d stops: %s", self.rank, error)
            return error.exit_code
        except OSError as exc:
            storage = storage_error(exc)
            if storage is None:
                raise
            self.runtime.fail(storage)
            self._finish(NodeState.FAILED, str(storage))
            log.error("rank %d stops: %s", self.rank, storage)
            return storage.exit_code
        except Exception as exc:
            log.exception("rank %d: unexpected error", self.rank)
            self.runtime.fail(CoordinatorError(f"internal error: {exc!r}"))
            self._finish(NodeState.FAILED, repr(exc))
            return ExitCode.INTERNAL
        finally:
            self.runtime.finished.set()
            self._dump_fs_stats()

    def _dump_fs_stats(self) -> None:
        """Benchmarks set COORDINATOR_FS_STATS to a directory to get our operation counts."""
        target = os.environ.get("COORDINATOR_FS_STATS")
        if not target:
            return
        from coordinator import fsio

        counts = {tag: dict(fsio.STATS.snapshot(tag))
                  for tag in ("poll", "heartbeat", "monitor", "other")}
        path = Path(target) / f"rank-{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rank": self.rank, "counts": counts}))

    def _start(self) -> None:
        run_id, generation = self.manifest.run_id, self.manifest.generation
        master_info = self.plan.master
        if self.is_master:
            self.probe_server = netaddr.ProbeServer(self.address)
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
        if self.plan.republish is not None:
            # Only the holder of rank 0 writes run.json (one writer per file).
            publish_record(self.store, layout.MANIFEST, self.plan.republish)
        base = Heartbeat(
            run_id=run_id, generation=generation, rank=self.rank, token=self.token,
            host=self.host, pid=os.getpid(), counter=0, state=NodeState.STARTING,
            iteration=self.journal.resume_iteration, phase=0, waiting_for="",
            arrived=None, released=None, session=None,
            resume_iteration=self.journal.resume_iteration, abort=None, error=None,
            wall_time=time.time(),
        )
        self.heartbeat = HeartbeatPublisher(
            self.store, base=base, interval_s=self.coord.heartbeat_interval_s,
            runtime=self.runtime,
            fence=lambda: fence_check(self.store, rank=self.rank, token=self.token, run_id=run_id,
                                      generation=generation, retry_s=self.coord.read_retry_s),
        )
        self.heartbeat.start()
        self.runtime.on_fail(self._publish_failure)
        self.runtime.on_last_words(lambda e: self._final_heartbeat(NodeState.FAILED, str(e)))
        log.info("rank %d joined run %s generation %d as pid %d on %s (%s)", self.rank, run_id,
                 generation, os.getpid(), self.host, self.address)
        if self.is_master:
            self._form_session()
        else:
            assert master_info is not None
            self._await_session(master_info.claim)
        # Each wait watches exactly the heartbeats it polls (a worker: the
        # master's; the master: the missing ranks'), so the inotify traffic a
        # worker sees does not grow with the node count.
        if self.coord.wakeups:
            fs_type = filesystem_type(self.plan.log_path)
            self.waker = Waker(local=fs_type in LOCAL_FILESYSTEMS)
            # A wait that polls only at the ceiling must still stop at once
            # when a peer is lost or a signal arrives.
            self.runtime.on_fail(lambda _error, event=self.waker.event: event.set())
            log.info("file-change wake-ups: %s on %s (%s): %s", self.waker.backend.value,
                     self.plan.log_path, fs_type or "unknown filesystem",
                     "polls are a safety net at the ceiling" if self.waker.local
                     else "writers on other hosts are seen by polling")
        self.actions = kind(self.config.run.actions).build(
            self.config, rank=self.rank, num_nodes=self.manifest.num_nodes,
            run_dir=self.plan.log_path)

    def _form_session(self) -> None:
        assert self.heartbeat is not None
        claims, beats = membership.gather_members(
            self.store, run_id=self.manifest.run_id, generation=self.manifest.generation,
            num_nodes=self.manifest.num_nodes, own=self.heartbeat.record,
            join_timeout_s=self.coord.join_timeout_s, lease_s=self.coord.lease_s,
            backoff=self.backoff, progress_interval_s=self.coord.progress_interval_s,
            retry_s=self.coord.read_retry_s, clock=self.clock, check=self.runtime.check,
        )
        members = {0: self.token} | {r: c.token for r, c in claims.items()}
        hosts = {0: self.host} | {r: c.host for r, c in claims.items()}
        start = min(hb.resume_iteration for hb in beats.values())
        session = Session(
            run_id=self.manifest.run_id, generation=self.manifest.generation, session=self.token,
            start_iteration=start, end_iteration=max(start, self.config.run.iterations),
            members={str(r): t for r, t in members.items()},
        )
        membership.publish_session(self.store, session)
        self.heartbeat.update(session=self.token, state=NodeState.RUNNING)
        log.info("group formed: ranks %s on hosts %s; iterations %d..%d", sorted(members),
                 [hosts[r] for r in sorted(hosts)], session.start_iteration,
                 session.end_iteration - 1)
        self._enter_session(session, hosts)

    def _await_session(self, master_claim: Claim) -> None:
        assert self.heartbeat is not None
        session = membership.wait_for_session(
            self.store, rank=self.rank, token=self.token, run_id=self.manifest.run_id,
            generation=self.manifest.generation, master_token=master_claim.token,
            join_timeout_s=self.coord.join_timeout_s, backoff=self.backoff,
            progress_interval_s=self.coord.progress_interval_s,
            retry_s=self.coord.read_retry_s, lease_s=self.coord.lease_s, clock=self.clock,
            check=self.runtime.check,
        )
        self.heartbeat.update(state=NodeState.RUNNING)
        self._enter_session(session, {0: master_claim.host})

    def _enter_session(self, session: Session, hosts: Mapping[int, str]) -> None:
        assert self.heartbeat is not None
        self.session = session
        members = {int(r): t for r, t in session.members.items()}
        tracker = PeerTracker(lease_s=self.coord.lease_s, run_id=self.manifest.run_id,
                              generation=self.manifest.generation)
        watched = [r for r in members if r != self.rank] if self.is_master else [0]
        now = self.clock.now()
        for r in watched:
            tracker.expect(r, token=members[r], host=hosts.get(r, "?"), now=now)
        self.monitor = Monitor(
            self.store, tracker, self.runtime,
            interval_s=min(1.0, self.coord.heartbeat_interval_s),
            retry_s=self.coord.read_retry_s, clock=self.clock.now,
            master_rank=None if self.is_master else 0,
        )
        self.monitor.start()
        self.membership = Membership(
            run_id=self.manifest.run_id, generation=self.manifest.generation,
            session=session.session, rank=self.rank, token=self.token, members=members,
            hosts=dict(hosts),
        )

    # -- the phases -----------------------------------------------------------
    def _loop(self) -> None:
        assert self.session is not None and self.heartbeat and self.monitor
        self.barrier = Barrier(
            self.store, self.membership, heartbeat=self.heartbeat, monitor=self.monitor,
            runtime=self.runtime, backoff=self.backoff,
            progress_interval_s=self.coord.progress_interval_s,
            retry_s=self.coord.read_retry_s, clock=self.clock, waker=self.waker,
            heartbeat_path=lambda r: self.store.path(layout.heartbeat(r)),
        )
        for iteration in range(self.session.start_iteration, self.session.end_iteration):
            releases: dict[int, Mapping[str, Any]] = {}
            timings: dict[str, dict[str, float]] = {}
            started = time.monotonic()
            for phase in self.phases:
                timings[str(int(phase))] = self._step(iteration, phase, releases)
            self.journal = self.journal.with_completed(iteration)
            self._publish_journal()
            total = time.monotonic() - started
            self._publish_timings(iteration, timings, total)
            log.info("rank %d completed iteration %d in %.2f s", self.rank, iteration, total)

    def _publish_timings(self, iteration: int, phases: dict[str, dict[str, float]],
                         total: float) -> None:
        body = {"schema": "coordinator/timings", "version": 1, "run_id": self.manifest.run_id,
                "iteration": iteration, "rank": self.rank, "total_s": total, "phases": phases}
        self.store.publish(layout.timings(iteration, self.rank),
                           json.dumps(body).encode())

    def _step(self, iteration: int, phase: Phase,
              releases: dict[int, Mapping[str, Any]]) -> dict[str, float]:
        """One phase on this rank; returns its timings (action, barrier wait)."""
        assert self.heartbeat is not None and self.actions is not None
        phase_spec = spec(phase)
        deadline = self.coord.phase_timeouts_s.of(phase_spec.timeout)
        if phase_spec.collective:
            previous = releases.get(int(phase) - 1, {})
            run = bool(previous.get("run", {}).get(str(int(phase)), True))
        else:
            run = not self.journal.is_done(iteration, phase)
        self.runtime.check()
        # Not published on its own: the heartbeat thread carries the new phase
        # within one interval, and the arrival publishes it at once.  Saving
        # this publish (two fsyncs) per phase matters with many ranks on one
        # filesystem.
        self.heartbeat.set(state=NodeState.RUNNING, iteration=iteration, phase=int(phase),
                           waiting_for="")
        ctx = self._context(iteration, phase, releases)
        status, error, payload = ArrivalStatus.OK, None, {}
        action_started = time.monotonic()
        if run:
            log.debug("rank %d iteration %d %s: action", self.rank, iteration, phase.label)
            try:
                payload = dict(self.actions.run(phase, ctx))
            except Cancelled:
                self.runtime.check()
                raise
            except (PeerLostError, FencedError, Interrupted, WaitTimeout, StorageError,
                    MalformedRecordError):
                raise
            except Exception as exc:
                # The group is stopping (a peer was lost, a signal came): the
                # action's error is a consequence, the recorded failure the cause.
                self.runtime.check()
                # A full or read-only shared filesystem fails this rank's
                # writes and its heartbeat alike: say so, do not report a
                # phase failure nobody can publish.
                storage = storage_error(exc)
                if storage is not None:
                    raise storage from exc
                log.exception("rank %d iteration %d %s failed", self.rank, iteration, phase.label)
                status, error = ArrivalStatus.FAILED, f"{type(exc).__name__}: {exc}"
            else:
                self.journal = self.journal.with_done(iteration, phase)
                self._publish_journal()
        else:
            log.info("rank %d iteration %d %s: already done (journal), not redone", self.rank,
                     iteration, phase.label)
        done = tuple(p for p in range(14) if self.journal.is_done(iteration, p))
        wait_started = time.monotonic()
        arrival = self.barrier.arrive(iteration, phase, status=status, error=error, done=done,
                                      payload=payload)
        arrived_at = time.time()
        if not self.is_master:
            if status is ArrivalStatus.FAILED:
                raise PhaseFailedError(
                    f"rank {self.rank} failed iteration {iteration} {phase.label}: {error}",
                    rank=self.rank, iteration=iteration, phase=int(phase), cause=error or "")
            release = self.barrier.wait_release(iteration, phase, deadline_s=deadline)
        else:
            try:
                if status is ArrivalStatus.FAILED:
                    raise PhaseFailedError(
                        f"rank 0 (the master, host {self.host}) failed iteration {iteration} "
                        f"{phase.label}: {error}",
                        rank=0, iteration=iteration, phase=int(phase), cause=error or "")
                arrivals = self.barrier.collect(iteration, phase, own=arrival, deadline_s=deadline)
                extra = self._decide(iteration, phase, ctx, arrivals)
            except Exception as exc:
                self._abort(iteration, phase, exc)
                raise
            release = self.barrier.release(iteration, phase, extra)
        releases[int(phase)] = release.payload
        if phase is Phase.TRAIN:
            self._close_listener()  # torchrun's store holds its own copy while it runs
        polls = self.barrier.last_wait.polls if self.barrier.last_wait else 0
        # Wall times let a benchmark on one machine compute release latency
        # (last arrival to last release) across ranks.
        return {"action_s": wait_started - action_started,
                "wait_s": time.monotonic() - wait_started, "polls": float(polls),
                "arrived_at": arrived_at, "released_at": time.time()}

    def _decide(self, iteration: int, phase: Phase, ctx: StepContext,
                arrivals: Mapping[int, Any]) -> dict[str, Any]:
        assert self.actions is not None
        payload = dict(self.actions.decide(phase, ctx, arrivals))
        run = self.config.run
        if phase is Phase.EVAL_DECISION:
            payload["eval"] = should_eval(iteration, eval_interval=run.eval_interval,
                                          eval_before_train=run.eval_before_train,
                                          split=run.rollout_split)
        if phase is Phase.READY_TO_TRAIN:
            self._close_listener()
            self.listener = netaddr.Listener(self.address)
            payload["master_addr"] = self.address
            payload["train_port"] = self.listener.port
        later = [p for p in self.phases if p > phase]
        if later and spec(later[0]).collective:
            nxt = later[0]
            payload["run"] = {str(int(nxt)): not all(int(nxt) in a.done for a in arrivals.values())}
        return payload

    def _abort(self, iteration: int, phase: Phase, exc: BaseException) -> None:
        kind_of = AbortKind.INTERNAL
        if isinstance(exc, PeerLostError):
            kind_of = AbortKind.LOST
        elif isinstance(exc, (PhaseFailedError, CoordinatorError)) and not isinstance(exc, WaitTimeout):
            kind_of = AbortKind.FAILED
        if isinstance(exc, WaitTimeout):
            kind_of = AbortKind.TIMEOUT
        if isinstance(exc, Cancelled) and self.runtime.failure is not None:
            exc = self.runtime.failure
            kind_of = AbortKind.LOST if isinstance(exc, PeerLostError) else AbortKind.FAILED
        abort = Abort(kind=kind_of, reason=str(exc), rank=getattr(exc, "rank", None),
                      iteration=iteration, phase=int(phase))
        try:
            self.barrier.abort(iteration, phase, abort)
        except (OSError, CoordinatorError) as err:
            log.error("could not publish the abort: %s", err)

    def _context(self, iteration: int, phase: Phase,
                 releases: dict[int, Mapping[str, Any]]) -> StepContext:
        return StepContext(
            rank=self.rank, num_nodes=self.manifest.num_nodes, iteration=iteration, phase=phase,
            run_dir=self.plan.log_path, run_id=self.manifest.run_id, config=self.config,
            weights=self.manifest.weights, host=self.host, address=self.address,
            runtime=self.runtime, releases=releases, listener=self.listener,
        )

    def _close_listener(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    # -- journal, failure, shutdown ----------------------------------------------
    def _load_journal(self) -> Journal:
        fresh = Journal(run_id=self.manifest.run_id, rank=self.rank, completed_iteration=-1,
                        iteration=0, done=())
        try:
            journal = read_record(self.store, layout.journal(self.rank), Journal,
                                  retry_s=self.coord.read_retry_s)
        except CoordinatorError as exc:
            log.warning("ignoring an unreadable journal: %s", exc)
            return fresh
        if journal is None or journal.run_id != self.manifest.run_id or journal.rank != self.rank:
            return fresh
        log.info("rank %d resumes from its journal: iterations up to %d complete, iteration %d "
                 "phases %s done", self.rank, journal.completed_iteration, journal.iteration,
                 list(journal.done))
        return journal

    def _publish_journal(self) -> None:
        publish_record(self.store, layout.journal(self.rank), self.journal)

    def _publish_failure(self, error: CoordinatorError) -> None:
        """Runtime hook: let peers know at once (the master's abort stops every worker)."""
        if self.heartbeat is None:
            return
        state = NodeState.LEFT if isinstance(error, Interrupted) else NodeState.FAILED
        changes: dict[str, Any] = {"state": state, "error": str(error)}
        if self.is_master and self.heartbeat.record.abort is None:
            abort_kind = (AbortKind.LOST if isinstance(error, (PeerLostError, Interrupted))
                          else AbortKind.TIMEOUT if isinstance(error, WaitTimeout)
                          else AbortKind.FAILED)
            hb = self.heartbeat.record
            changes["abort"] = Abort(kind=abort_kind, reason=str(error),
                                     rank=getattr(error, "rank", None), iteration=hb.iteration,
                                     phase=hb.phase)
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
        if self.actions is not None:
            try:
                self.actions.close()
            except Exception:  # shutdown path: log and go on stopping
                log.exception("closing the actions failed")
        self.runtime.kill_children()
        self._final_heartbeat(state, error)
        if self.heartbeat is not None and not isinstance(self.runtime.failure, FencedError):
            membership.release_claim(self.store, self.rank, self.token,
                                     retry_s=self.coord.read_retry_s)
        if self.waker is not None:
            self.waker.close()
        if self.probe_server is not None:
            self.probe_server.close()
        self._close_listener()

    def _install_signals(self) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            signal.signal(signum, signal.SIG_DFL)  # a second signal kills at once
            raise Interrupted(signum)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
