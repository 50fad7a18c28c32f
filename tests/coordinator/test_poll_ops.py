"""Filesystem operations per barrier poll, counted by the instrumented layer.

A worker reads one file per poll whatever the node count; the master reads
one heartbeat per rank still missing.  A change that adds filesystem traffic
to a poll fails here.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from coordinator.machine.barrier import Barrier
from coordinator.machine.decisions import Membership
from coordinator.machine.liveness import HeartbeatPublisher, Monitor, PeerTracker
from coordinator.machine.polling import Backoff, Clock
from coordinator.machine.runtime import Runtime
from coordinator.records import layout
from coordinator.records.records import Arrival, ArrivalStatus, NodeState
from coordinator.storage import fsio
from coordinator.storage.store import FsStore, publish_record
from tests.coordinator.test_records import heartbeat


class CountingClock(Clock):
    """Instant sleeps; snapshots the poll-tagged operation counts at each sleep."""

    def __init__(self, on_sleep) -> None:
        self.t = 0.0
        self.on_sleep = on_sleep

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float, wake: threading.Event | None = None) -> None:
        self.t += seconds
        self.on_sleep()


def make_barrier(tmp_path: Path, rank: int, num_nodes: int, clock: Clock) -> Barrier:
    store = FsStore(tmp_path)
    members = {r: f"t{r}" for r in range(num_nodes)}
    for r in range(num_nodes):
        publish_record(store, layout.heartbeat(r), heartbeat(
            rank=r, token=members[r], session="s", arrived=None, released=None))
    runtime = Runtime()
    me = heartbeat(rank=rank, token=members[rank], session="s", arrived=None, released=None)
    publisher = HeartbeatPublisher(store, base=me, interval_s=1.0, runtime=runtime)
    tracker = PeerTracker(lease_s=1e9, run_id="r", generation=0)
    for r in range(num_nodes):
        if r != rank:
            tracker.expect(r, token=members[r], host="h", now=0.0)
    monitor = Monitor(store, tracker, runtime, interval_s=1.0, retry_s=1.0, clock=clock.now)
    m = Membership(run_id="r", generation=0, session="s", rank=rank, token=members[rank],
                   members=members, hosts={r: "h" for r in members})
    return Barrier(store, m, heartbeat=publisher, monitor=monitor, runtime=runtime,
                   backoff=Backoff(initial_s=0.01, factor=1.5, ceiling_s=1.0),
                   progress_interval_s=1e9, retry_s=1.0, clock=clock)


def per_poll_counts(run_polls) -> list[tuple[int, int]]:
    """(metadata, data) operations of each poll after the first."""
    snapshots = []
    fsio.STATS.reset()

    def snap() -> None:
        snapshots.append(fsio.FsStats.split(fsio.STATS.snapshot("poll")))
        fsio.STATS.reset()

    with fsio.STATS.tagged("poll"):
        run_polls(snap)
    return snapshots[1:]


@pytest.mark.parametrize("num_nodes", [3, 64])
def test_a_worker_reads_one_file_per_poll_whatever_the_node_count(tmp_path, num_nodes) -> None:
    polls = 12

    def run(snap) -> None:
        calls = {"n": 0}

        def on_sleep() -> None:
            snap()
            calls["n"] += 1
            if calls["n"] == polls:
                raise StopIteration

        clock = CountingClock(on_sleep)
        barrier = make_barrier(tmp_path, 1, num_nodes, clock)
        with pytest.raises(StopIteration):
            barrier.wait_release(0, 3, deadline_s=1e6)

    counts = per_poll_counts(run)
    assert len(counts) == polls - 1
    # open() of the master's heartbeat; read() of its bytes and of EOF.
    assert set(counts) == {(1, 2)}


@pytest.mark.parametrize(("num_nodes", "arrived"), [(3, 0), (64, 0), (64, 60)])
def test_the_master_reads_one_heartbeat_per_missing_rank(tmp_path, num_nodes, arrived) -> None:
    store = FsStore(tmp_path)

    def run(snap) -> None:
        calls = {"n": 0}

        def on_sleep() -> None:
            snap()
            calls["n"] += 1
            if calls["n"] == 6:
                raise StopIteration

        clock = CountingClock(on_sleep)
        barrier = make_barrier(tmp_path, 0, num_nodes, clock)
        # Ranks 1..arrived have arrived at (0, 3) before the master looks.
        for r in range(1, arrived + 1):
            publish_record(store, layout.arrival(0, 3, r), Arrival(
                run_id="r", generation=0, session="s", rank=r, token=f"t{r}", iteration=0,
                phase=3, status=ArrivalStatus.OK, error=None, done=(), payload={}))
            publish_record(store, layout.heartbeat(r), heartbeat(
                rank=r, token=f"t{r}", session="s", arrived=(0, 3), state=NodeState.WAITING))
        own = Arrival(run_id="r", generation=0, session="s", rank=0, token="t0", iteration=0,
                      phase=3, status=ArrivalStatus.OK, error=None, done=(), payload={})
        with pytest.raises(StopIteration):
            barrier.collect(0, 3, own=own, deadline_s=1e6)

    counts = per_poll_counts(run)
    missing = num_nodes - 1 - arrived
    assert set(counts) == {(missing, 2 * missing)}


class FakeWaker:
    """The Waker interface with a scripted set of renamed files."""

    def __init__(self, complete: bool = False) -> None:
        self.event = threading.Event()
        self.changed: set[str] = set()
        self.complete = complete

    def watch(self, paths) -> None:  # type: ignore[no-untyped-def]
        pass

    def drain(self) -> set[str]:
        changed, self.changed = self.changed, set()
        return changed


def test_a_master_woken_by_a_rename_reads_only_the_renamed_heartbeat(tmp_path) -> None:
    waker = FakeWaker()
    polls = {"n": 0}

    class WakingClock(CountingClock):
        def sleep(self, seconds: float, wake: threading.Event | None = None) -> bool:
            self.t += 0.001  # an event arrives at once: well within the poll ceiling
            self.on_sleep()
            return True

    def run(snap) -> None:
        def on_sleep() -> None:
            snap()
            polls["n"] += 1
            waker.changed = {str(tmp_path / layout.heartbeat(5))}
            if polls["n"] == 4:
                raise StopIteration

        clock = WakingClock(on_sleep)
        barrier = make_barrier(tmp_path, 0, 64, clock)
        barrier.waker = waker  # type: ignore[assignment]
        barrier.heartbeat_path = lambda r: tmp_path / layout.heartbeat(r)
        own = Arrival(run_id="r", generation=0, session="s", rank=0, token="t0", iteration=0,
                      phase=3, status=ArrivalStatus.OK, error=None, done=(), payload={})
        with pytest.raises(StopIteration):
            barrier.collect(0, 3, own=own, deadline_s=1e6)

    fsio.STATS.reset()
    counts = per_poll_counts(run)
    # The first poll swept all 63 missing ranks; each woken poll read one heartbeat.
    assert counts == [(1, 2)] * 3


@pytest.mark.parametrize("complete", [False, True])
def test_a_waiter_whose_every_rename_wakes_it_polls_only_at_the_ceiling(tmp_path,
                                                                        complete) -> None:
    """On a local filesystem the timed poll is a safety net: one per ceiling, not a ramp."""
    waker = FakeWaker(complete)
    slept: list[float] = []

    def on_sleep() -> None:
        if len(slept) == 8:
            raise StopIteration

    class RecordingClock(CountingClock):
        def sleep(self, seconds: float, wake: threading.Event | None = None) -> None:
            slept.append(seconds)
            super().sleep(seconds, wake)

    barrier = make_barrier(tmp_path, 1, 3, RecordingClock(on_sleep))
    barrier.waker = waker  # type: ignore[assignment]
    with pytest.raises(StopIteration):
        barrier.wait_release(0, 3, deadline_s=1e6)
    if complete:
        assert slept == [1.0] * 8
    else:
        assert slept[0] == 0.01 and slept == sorted(slept)
