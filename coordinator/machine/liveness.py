"""Heartbeats and leases.

Each daemon publishes a heartbeat record every `heartbeat_interval_s` (and at
once on every state change) with a counter that only grows.  A peer is lost
when its counter has not advanced for `lease_s` on the *observer's*
monotonic clock, counted from the moment the observer first saw the current
value: clock skew between nodes and cached mtimes cannot matter.

`PeerTracker` turns observations into verdicts (a pure function of what was
read and when); `Monitor` is the thread that reads the heartbeats a daemon
needs and reports the first verdict to the `Runtime`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from coordinator.config.run_config import CoordinationConfig
from coordinator.errors import CoordinatorError, FencedError, PeerLostError, PhaseFailedError
from coordinator.machine.polling import Clock
from coordinator.machine.runtime import Runtime
from coordinator.records import layout
from coordinator.records.phases import Phase
from coordinator.records.records import (
    JOINABLE_STATES,
    Abort,
    AbortKind,
    Claim,
    Heartbeat,
    Manifest,
    NodeState,
)
from coordinator.storage import fsio
from coordinator.storage.store import Store, publish_record, read_record

log = logging.getLogger(__name__)

# Check our own claim and the manifest every this many beats: cheap fencing
# against a `recover --force` or a replacement daemon taking our rank.
FENCE_CHECK_EVERY = 5


class HeartbeatPublisher:
    """Owns this daemon's heartbeat record; thread-safe `update` + periodic beat."""

    def __init__(
        self, store: Store, *, base: Heartbeat, interval_s: float, runtime: Runtime,
        fence: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.interval_s = interval_s
        self.runtime = runtime
        self.fence = fence
        self._record = base
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self.key = layout.heartbeat(base.rank)

    @classmethod
    def starting(cls, store: Store, claim: Claim, *, resume_iteration: int, interval_s: float,
                 runtime: Runtime, retry_s: float) -> HeartbeatPublisher:
        """The publisher of the rank `claim` holds, fenced by it: a beat stops the
        daemon once another process took the rank or the run's generation moved on."""
        base = Heartbeat(
            run_id=claim.run_id, generation=claim.generation, rank=claim.rank,
            token=claim.token, host=claim.host, pid=claim.pid, counter=0,
            state=NodeState.STARTING, iteration=resume_iteration, phase=0, waiting_for="",
            arrived=None, released=None, session=None, resume_iteration=resume_iteration,
            abort=None, error=None, wall_time=time.time())
        return cls(store, base=base, interval_s=interval_s, runtime=runtime,
                   fence=lambda: fence_check(store, rank=claim.rank, token=claim.token,
                                             run_id=claim.run_id, generation=claim.generation,
                                             retry_s=retry_s))

    @property
    def record(self) -> Heartbeat:
        return self._record

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def set(self, **changes: Any) -> None:
        """Change fields without publishing: the next beat carries them."""
        with self._lock:
            self._record = dataclasses.replace(self._record, **_with_fault(changes))

    def update(self, **changes: Any) -> Heartbeat:
        """Change fields and publish at once (state changes must not wait a beat)."""
        return self.beat(**changes)

    def beat(self, **changes: Any) -> Heartbeat:
        with self._lock:
            record = dataclasses.replace(
                self._record, counter=self._record.counter + 1, wall_time=time.time(),
                **_with_fault(changes)
            )
            with fsio.STATS.tagged("heartbeat"):
                publish_record(self.store, self.key, record)
            self._record = record
            return record

    def stop(self, **final: Any) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.interval_s + 1)
        if final:
            try:
                self.beat(**final)
            except (OSError, CoordinatorError) as exc:  # shutdown path: report, do not raise
                log.error("could not publish the final heartbeat: %s", exc)

    def _run(self) -> None:
        beats = 0
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
                beats += 1
                if self.fence is not None and beats % FENCE_CHECK_EVERY == 0:
                    self.fence()
            except CoordinatorError as exc:
                # Fenced, a full or read-only filesystem (StorageError), or a
                # claim or manifest turned into something that is not one: a
                # daemon that cannot beat must stop, saying why, rather than
                # be declared lost by its peers a lease later.
                self.runtime.fail(exc)
                return
            except OSError as exc:
                # A transient filesystem error costs one beat; the lease is
                # several beats long, so peers do not notice.
                log.warning("heartbeat publish failed (will retry): %s", exc)


def fence_check(store: Store, *, rank: int, token: str, run_id: str, generation: int,
                retry_s: float) -> None:
    """Raise FencedError when our claim was taken or the generation was bumped."""
    claim = read_record(store, layout.claim(rank), Claim, retry_s=retry_s)
    if claim is None or claim.token != token:
        holder = f"pid {claim.pid} on {claim.host}" if claim else "nobody"
        raise FencedError(
            f"rank {rank}'s claim is now held by {holder}, not by this daemon: stopping so that "
            "two daemons never write for one rank"
        )
    manifest = read_record(store, layout.MANIFEST, Manifest, retry_s=retry_s)
    if manifest is not None and (manifest.run_id != run_id or manifest.generation > generation):
        raise FencedError(
            f"run {manifest.run_id} generation {manifest.generation} superseded this daemon's "
            f"run {run_id} generation {generation} (coordinator recover or a new run): "
            "restart the daemon with its original command"
        )


@dataclasses.dataclass
class PeerView:
    rank: int
    token: str
    host: str
    counter: int = -1
    changed_at: float = 0.0
    last: Heartbeat | None = None
    # Seen at work in this session: from then on `regrouping` means it left it
    # (before, it is still on its way in from the last regroup).
    joined: bool = False
    newcomer: Heartbeat | None = None  # a heartbeat of another incarnation of the rank


def describe_phase(phase: int) -> str:
    try:
        return Phase(phase).label
    except ValueError:
        return f"phase {phase}"


def _with_fault(changes: dict[str, Any]) -> dict[str, Any]:
    """A new error without a fault clears the old fault: it described another failure."""
    return {"fault": "", **changes} if "error" in changes else changes


def rank_failed(rank: int, host: str, iteration: int, phase: int,
                error: str | None, fault: str | None = None) -> PhaseFailedError:
    """A rank's own failure, worded the same whether the master learns it from
    the rank's arrival record or the monitor from its heartbeat, whichever is first;
    `fault`: the signature the rank published (heartbeat), else one from `error`."""
    return PhaseFailedError(
        f"rank {rank} (host {host}) failed iteration {iteration} {describe_phase(phase)}: "
        f"{error or 'no reason given'}",
        rank=rank, iteration=iteration, phase=phase, cause=error or "", fault=fault or None,
    )


class PeerTracker:
    """Lease bookkeeping for the peers a daemon needs; pure given `now`."""

    def __init__(self, *, lease_s: float, run_id: str, generation: int,
                 attribute_s: float | None = None) -> None:
        self.lease_s = lease_s
        self.run_id = run_id
        self.generation = generation
        self.peers: dict[int, PeerView] = {}
        # Master: how long a peer's failed collective step waits for the others to
        # prove alive (or one to be lost) before it is blamed; None on workers,
        # who wait for the master's verdict instead.
        self.attribute_s = attribute_s
        self.blame_since: float | None = None

    def expect(self, rank: int, *, token: str, host: str, now: float) -> None:
        self.peers[rank] = PeerView(rank=rank, token=token, host=host, changed_at=now)

    def observe(self, rank: int, hb: Heartbeat | None, now: float) -> None:
        view = self.peers[rank]
        if hb is None or hb.run_id != self.run_id or hb.generation < self.generation:
            return  # absent or from another run/older generation: not a sign of life
        if hb.token != view.token:
            view.newcomer = hb  # a new incarnation: the verdict reports it
            return
        if hb.counter != view.counter:
            view.counter, view.changed_at = hb.counter, now
        if hb.state not in JOINABLE_STATES:
            view.joined = True
        view.last = hb

    def age(self, rank: int, now: float) -> float:
        return now - self.peers[rank].changed_at

    def where(self, rank: int) -> str:
        hb = self.peers[rank].last
        if hb is None:
            return "before its first heartbeat"
        return f"at iteration {hb.iteration} {describe_phase(hb.phase)}"

    def verdict(self, rank: int, now: float) -> PeerLostError | PhaseFailedError | None:
        view = self.peers[rank]
        hb = view.last
        who = f"rank {rank} (host {view.host})"
        new = view.newcomer
        if new is not None:
            return PeerLostError(
                f"{who} was restarted {self.where(rank)} (new pid {new.pid} on {new.host}) while "
                "the group was running (with on_failure 'exit': run `coordinator recover`, "
                "restart every node)", rank=rank, host=new.host,
                iteration=hb.iteration if hb else None, phase=hb.phase if hb else None,
            )
        if hb is not None and hb.state is NodeState.REGROUPING and view.joined and hb.fault:
            # It stopped to regroup after a step of its own failed: that failure.
            return rank_failed(rank, view.host, hb.iteration, hb.phase, hb.error, hb.fault)
        if hb is not None and hb.state is NodeState.REGROUPING and view.joined:
            return PeerLostError(
                f"{who} stopped its work {self.where(rank)} to re-form the group: "
                f"{hb.error or 'no reason given'}",
                rank=rank, host=view.host, iteration=hb.iteration, phase=hb.phase,
            )
        if hb is not None and hb.state is NodeState.LEFT:
            return PeerLostError(
                f"{who} left {self.where(rank)} (SIGTERM or Ctrl-C)",
                rank=rank, host=view.host, iteration=hb.iteration, phase=hb.phase,
            )
        if hb is not None and hb.state is NodeState.FAILED:
            return rank_failed(rank, view.host, hb.iteration, hb.phase, hb.error, hb.fault)
        if hb is not None and hb.state is NodeState.FINISHED:
            return None
        age = self.age(rank, now)
        if age > self.lease_s:
            return PeerLostError(
                f"{who} lost {self.where(rank)}: its heartbeat has not advanced for {age:.1f} s "
                f"(lease {self.lease_s:g} s)",
                rank=rank, host=view.host,
                iteration=hb.iteration if hb else None, phase=hb.phase if hb else None,
                heartbeat_age_s=age,
            )
        return None

    def first_verdict(self, now: float) -> PeerLostError | PhaseFailedError | None:
        """The verdict to act on: a lost, left, failed or restarted peer first; then
        a peer whose collective step failed, once every other peer has beaten since
        it was seen (or the attribution time is over): a peer that died took the
        collective step down on the survivors, and it is the one to name."""
        for rank in self.peers:
            verdict = self.verdict(rank, now)
            if verdict is not None:
                return verdict
        failing = [v for v in self.peers.values() if v.last is not None
                   and v.last.token == v.token and v.last.state is NodeState.STEP_FAILED]
        if not failing or self.attribute_s is None:
            self.blame_since = None
            return None
        if self.blame_since is None:
            self.blame_since = now
            return None
        everyone_beat = all(v.changed_at > self.blame_since for v in self.peers.values())
        if everyone_beat or now - self.blame_since > self.attribute_s:
            first = failing[0]
            hb = first.last
            assert hb is not None
            return rank_failed(first.rank, first.host, hb.iteration, hb.phase, hb.error,
                               hb.fault)
        return None

    def master_abort(self, rank: int) -> Abort | None:
        hb = self.peers[rank].last
        return hb.abort if hb is not None and hb.token == self.peers[rank].token else None


def abort_error(abort: Abort, *, by: str = "the master") -> PeerLostError | PhaseFailedError:
    """The error a worker raises when the master's heartbeat or release aborts."""
    message = f"{by} aborted the run: {abort.reason}"
    if abort.kind is AbortKind.LOST:
        return PeerLostError(message, rank=abort.rank if abort.rank is not None else -1,
                             iteration=abort.iteration, phase=abort.phase)
    error = PhaseFailedError(message, rank=abort.rank, iteration=abort.iteration or 0,
                             phase=abort.phase or 0, cause=abort.reason)
    error.exit_code = abort.kind.exit_code
    return error


class Monitor:
    """Reads the needed peers' heartbeats and fails the runtime on a verdict."""

    def __init__(
        self, store: Store, tracker: PeerTracker, runtime: Runtime, *, interval_s: float,
        retry_s: float, clock: Callable[[], float] = time.monotonic,
        master_rank: int | None = None,
    ) -> None:
        self.store = store
        self.tracker = tracker
        self.runtime = runtime
        self.interval_s = interval_s
        self.retry_s = retry_s
        self.clock = clock
        self.master_rank = master_rank  # set on workers: obey the master's abort
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No verdict after this returns (a regroup clears the failure next)."""
        with self._lock:
            self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.interval_s + self.retry_s + 1)

    def observe(self, rank: int, hb: Heartbeat | None) -> None:
        """Feed an observation made elsewhere (a barrier poll) into the tracker."""
        with self._lock:
            self.tracker.observe(rank, hb, self.clock())

    def all_beat_since(self, since: float) -> bool:
        """Whether every watched peer's heartbeat advanced after `since` (this clock)."""
        with self._lock:
            return all(view.changed_at > since for view in self.tracker.peers.values())

    def sweep(self, ranks: Mapping[int, Any] | None = None) -> None:
        for rank in list(ranks or self.tracker.peers):
            hb = read_record(self.store, layout.heartbeat(rank), Heartbeat, retry_s=self.retry_s)
            self.observe(rank, hb)
        self.judge()

    def judge(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            now = self.clock()
            if self.master_rank is not None and self.master_rank in self.tracker.peers:
                abort = self.tracker.master_abort(self.master_rank)
                if abort is not None:
                    self.runtime.fail(abort_error(abort))
                    return
            verdict = self.tracker.first_verdict(now)
            if verdict is not None:
                self.runtime.fail(verdict)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.runtime.failure is not None:
                return
            try:
                with fsio.STATS.tagged("monitor"):
                    self.sweep()
            except Exception as exc:  # a bad read must not kill the watcher
                log.warning("heartbeat sweep failed (will retry): %s", exc)


def session_monitor(store: Store, runtime: Runtime, coord: CoordinationConfig, *, rank: int,
                    run_id: str, generation: int, members: Mapping[int, str],
                    hosts: Mapping[int, str], clock: Clock) -> Monitor:
    """The watch a daemon keeps over one session: the master watches every other
    member, a worker the master.  Started."""
    is_master = rank == 0
    tracker = PeerTracker(
        lease_s=coord.lease_s, run_id=run_id, generation=generation,
        attribute_s=coord.lease_s + coord.heartbeat_interval_s if is_master else None)
    now = clock.now()
    for r in ([r for r in members if r != rank] if is_master else [0]):
        tracker.expect(r, token=members[r], host=hosts.get(r, "?"), now=now)
    monitor = Monitor(store, tracker, runtime, interval_s=min(1.0, coord.heartbeat_interval_s),
                      retry_s=coord.read_retry_s, clock=clock.now,
                      master_rank=None if is_master else 0)
    monitor.start()
    return monitor
