"""The phase barrier: arrivals from every rank, one release from the master.

    rank r:  publish arrive-r.json -> heartbeat.arrived = (N, K)
    master:  poll the heartbeats of the ranks still missing; once one says
             arrived (N, K), open its arrival record (it exists by then)
             all arrived -> decide -> publish release.json -> heartbeat.released = (N, K)
    worker:  poll the master's heartbeat (one file); once it says released
             (N, K) for this session, open release.json

Waiters only open files whose writer has announced them, so a client-side
negative lookup cache on NFS never hides a record (docs/PROTOCOL.md, rule 4).
Per poll a worker reads one file and the master reads one per missing rank.
Each poll also feeds the lease tracker, so a wait notices a dead rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from coordinator.errors import MalformedRecordError, fault_signature
from coordinator.machine.decisions import (
    Heard,
    MasterAction,
    Membership,
    ReleaseAction,
    announced,
    current,
    from_master,
    judge_arrivals,
    judge_release,
    usable_arrival,
)
from coordinator.machine.liveness import (
    HeartbeatPublisher,
    Monitor,
    abort_error,
    describe_phase,
    rank_failed,
)
from coordinator.machine.polling import Backoff, Clock, Wait
from coordinator.machine.runtime import Runtime
from coordinator.records import layout
from coordinator.records.records import (
    Abort,
    Arrival,
    ArrivalStatus,
    Decision,
    Heartbeat,
    NodeState,
    Release,
)
from coordinator.storage import fsio
from coordinator.storage.store import Store, publish_record, read_record
from coordinator.storage.waker import Waker

log = logging.getLogger(__name__)


class Barrier:
    def __init__(
        self,
        store: Store,
        membership: Membership,
        *,
        heartbeat: HeartbeatPublisher,
        monitor: Monitor,
        runtime: Runtime,
        backoff: Backoff,
        progress_interval_s: float,
        retry_s: float,
        clock: Clock | None = None,
        waker: Waker | None = None,
        heartbeat_path: Callable[[int], Any] | None = None,
        failure_state: NodeState = NodeState.FAILED,
    ) -> None:
        self.store = store
        # What a failed arrival or an abort says in the heartbeat: `failed`, or
        # `regrouping` when the daemon will re-form the group (regroup.py).
        self.failure_state = failure_state
        self.m = membership
        self.heartbeat = heartbeat
        self.monitor = monitor
        self.runtime = runtime
        self.backoff = backoff
        self.progress_interval_s = progress_interval_s
        self.retry_s = retry_s
        self.clock = clock or Clock()
        self.waker = waker
        self.heartbeat_path = heartbeat_path
        self.last_wait: Wait | None = None
        self._heartbeat_paths: dict[int, str] = {}  # as the Waker reports them

    # -- every rank -------------------------------------------------------
    def arrive(
        self, iteration: int, phase: int, *, status: ArrivalStatus, error: str | None,
        done: tuple[int, ...], payload: Mapping[str, Any], awaits_verdict: bool = False,
    ) -> Arrival:
        """Publish this rank's arrival; a failed one also marks the heartbeat FAILED,
        unless the rank `awaits_verdict` (a collective step, whose failure the
        master attributes before anyone stops: coordinator/machine/stepper.py)."""
        record = Arrival(
            run_id=self.m.run_id, generation=self.m.generation, session=self.m.session,
            rank=self.m.rank, token=self.m.token, iteration=iteration, phase=phase,
            status=status, error=error, done=done, payload=dict(payload),
        )
        publish_record(self.store, layout.arrival(iteration, phase, self.m.rank), record)
        state = NodeState.WAITING
        if status is ArrivalStatus.FAILED:
            state = NodeState.STEP_FAILED if awaits_verdict else self.failure_state
        changes: dict[str, Any] = {"arrived": (iteration, phase), "state": state, "error": error,
                                   "fault": fault_signature(error or "") if status is
                                   ArrivalStatus.FAILED else ""}
        if self.m.is_master and status is ArrivalStatus.OK:
            self.heartbeat.set(**changes)  # nobody polls for the master's arrival
        else:
            self.heartbeat.update(**changes)
        return record

    # -- master -------------------------------------------------------------
    def collect(
        self, iteration: int, phase: int, *, own: Arrival, deadline_s: float
    ) -> dict[int, Arrival]:
        """Wait until every rank arrived; raise on a failed arrival or a lost rank."""
        arrivals: dict[int, Arrival] = {self.m.rank: own}
        missing = sorted(r for r in self.m.members if r != self.m.rank)
        last_seen: dict[int, Heartbeat | None] = {}
        swept = [float("-inf")]

        def targets() -> list[int]:
            """Every missing rank, unless a file event says exactly which ones changed.

            Woken by events, the master reads only the heartbeats that were
            renamed, so a barrier costs O(N) reads instead of O(N) per arrival;
            a full sweep still runs on every timed poll and at least once per
            poll ceiling, in case an event was lost.
            """
            now = self.clock.now()
            wait = self.last_wait
            if self.waker is None or wait is None or not wait.woken or \
                    now - swept[0] >= self.backoff.ceiling_s:
                if self.waker is not None:
                    self.waker.drain()
                swept[0] = now
                return list(missing)
            changed = self.waker.drain()
            # probe() has just watched every missing rank: their paths are cached.
            return [r for r in missing if self._heartbeat_paths.get(r) in changed] \
                if self.heartbeat_path is not None else list(missing)

        def probe() -> dict[int, Arrival] | None:
            # Watch before reading: a rename after our read then still wakes us.
            self._watch(missing)
            for rank in targets():
                hb = read_record(self.store, layout.heartbeat(rank), Heartbeat,
                                 retry_s=self.retry_s)
                self.monitor.observe(rank, hb)
                last_seen[rank] = hb
                if not announced(hb, self.m, rank, "arrived", (iteration, phase)):
                    continue
                record = self._read_arrival(iteration, phase, rank)
                if record is None:
                    continue
                arrivals[rank] = record
                missing.remove(rank)
            verdict = judge_arrivals(arrivals, list(self.m.members))
            if verdict.action is MasterAction.ABORT:
                failed = verdict.failed
                assert failed is not None
                raise rank_failed(failed.rank, self.m.hosts.get(failed.rank, "?"), iteration,
                                  phase, failed.error)
            if verdict.action is MasterAction.RELEASE:
                return arrivals
            self.monitor.judge()
            return None

        def describe() -> str:
            return self._describe_missing(missing, last_seen, iteration, phase)

        return self._wait(probe, describe, deadline_s)

    def release(
        self, iteration: int, phase: int, payload: Mapping[str, Any]
    ) -> Release:
        record = Release(
            run_id=self.m.run_id, generation=self.m.generation, session=self.m.session,
            iteration=iteration, phase=phase, decision=Decision.CONTINUE, abort=None,
            payload=dict(payload),
        )
        publish_record(self.store, layout.release(iteration, phase), record)
        self.heartbeat.update(released=(iteration, phase), state=NodeState.RUNNING,
                              waiting_for="")
        return record

    def abort(self, iteration: int, phase: int, abort: Abort) -> None:
        """Publish an abort release and put the abort into the heartbeat."""
        record = Release(
            run_id=self.m.run_id, generation=self.m.generation, session=self.m.session,
            iteration=iteration, phase=phase, decision=Decision.ABORT, abort=abort, payload={},
        )
        try:
            publish_record(self.store, layout.release(iteration, phase), record)
        finally:
            self.heartbeat.update(abort=abort, released=(iteration, phase),
                                  state=self.failure_state, error=abort.reason)

    # -- worker -------------------------------------------------------------
    def wait_release(self, iteration: int, phase: int, *, deadline_s: float) -> Release:
        master = 0
        last_seen: dict[int, Heartbeat | None] = {}

        def probe() -> Release | None:
            self._watch([master])  # before reading, as in collect()
            hb = read_record(self.store, layout.heartbeat(master), Heartbeat,
                             retry_s=self.retry_s)
            self.monitor.observe(master, hb)
            last_seen[master] = hb
            heard = from_master(hb, self.m, (iteration, phase))
            if heard is Heard.ABORTED:
                assert hb is not None and hb.abort is not None
                raise abort_error(hb.abort)
            if heard is Heard.RELEASED:
                record = read_record(self.store, layout.release(iteration, phase), Release,
                                     retry_s=self.retry_s)
                verdict = judge_release(record, self.m)
                if verdict is ReleaseAction.IGNORE and record is not None:
                    self._log_foreign(record)
                if verdict is ReleaseAction.ABORT:
                    assert record is not None and record.abort is not None
                    raise abort_error(record.abort)
                if verdict is ReleaseAction.CONTINUE:
                    assert record is not None
                    return record
            self.monitor.judge()
            return None

        def describe() -> str:
            return self._describe_missing([master], last_seen, iteration, phase,
                                          what="the master's release of")

        return self._wait(probe, describe, deadline_s)

    # -- helpers ------------------------------------------------------------
    def _wait(self, probe: Callable[[], Any], describe: Callable[[], str], deadline_s: float) -> Any:
        # The arrival just published the heartbeat; what we wait for rides
        # along with the next beat or progress report, not a publish of its own.
        self.heartbeat.set(waiting_for=describe())
        # Where every rename wakes us (a local filesystem), fast polls would
        # only burn CPU that the ranks share: poll at the ceiling, as a net.
        complete = self.waker is not None and self.waker.complete
        backoff = self.backoff if not complete else Backoff(
            initial_s=self.backoff.ceiling_s, factor=1.0, ceiling_s=self.backoff.ceiling_s)
        wait = Wait(
            deadline_s=deadline_s, backoff=backoff,
            progress_interval_s=self.progress_interval_s, describe=describe, clock=self.clock,
            wake=self.waker.event if self.waker else None, check=self.runtime.check,
            on_progress=self._report_progress, logger=log,
        )
        self.last_wait = wait
        with fsio.STATS.tagged("poll"):
            return wait.until(probe)

    def _report_progress(self, text: str) -> None:
        """What a long wait waits for goes into the heartbeat, for `status`."""
        self.heartbeat.update(waiting_for=text)

    def _log_foreign(self, record: Arrival | Release) -> None:
        log.info("ignoring %s from run %s generation %d session %s (current: %s/%d/%s)",
                 type(record).__name__.lower(), record.run_id, record.generation,
                 record.session, self.m.run_id, self.m.generation, self.m.session)

    def _read_arrival(self, iteration: int, phase: int, rank: int) -> Arrival | None:
        try:
            record = read_record(self.store, layout.arrival(iteration, phase, rank), Arrival,
                                 retry_s=self.retry_s)
        except MalformedRecordError as exc:
            log.warning("unreadable arrival of rank %d: %s", rank, exc)
            return None
        if record is not None and not current(record, self.m):
            self._log_foreign(record)
        return record if usable_arrival(record, self.m, rank, (iteration, phase)) else None

    def _watch(self, ranks: list[int]) -> None:
        if self.waker is not None and self.heartbeat_path is not None:
            paths = self._heartbeat_paths
            for r in ranks:
                if r not in paths:
                    paths[r] = str(self.heartbeat_path(r))
            self.waker.watch(paths[r] for r in ranks)

    def _describe_missing(
        self, missing: list[int], seen: Mapping[int, Heartbeat | None], iteration: int,
        phase: int, what: str = "",
    ) -> str:
        if not missing:
            return "nothing"
        rank = missing[0]
        tracker = self.monitor.tracker
        age = tracker.age(rank, self.clock.now()) if rank in tracker.peers else float("nan")
        hb = seen.get(rank)
        host = hb.host if hb else self.m.hosts.get(rank, "?")
        at = f"iteration {iteration} {describe_phase(phase)}"
        where = ""
        if hb is not None and what == "":
            where = f" (it is at iteration {hb.iteration} {describe_phase(hb.phase)}, {hb.state.value})"
        subject = f"{what} {at}" if what else f"rank {rank} at {at}{where}"
        more = f" and {len(missing) - 1} more rank(s): {missing[1:6]}" if len(missing) > 1 else ""
        return (f"{subject}, last heartbeat {age:.1f} s ago on host {host}{more}")
