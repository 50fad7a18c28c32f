"""What the waits of a re-forming group say and enforce (coordinator/machine/group.py),
on the store's in-memory fake with time injected: the deadline a waiting master
prints is the one gather_members enforces, and a worker that runs out of
rejoin_timeout_s says so, whichever of its waits it was in."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

import pytest

from coordinator.config.run_config import CoordinationConfig
from coordinator.errors import PeerLostError
from coordinator.machine import regroup
from coordinator.machine.group import GroupForming
from coordinator.machine.liveness import HeartbeatPublisher
from coordinator.machine.polling import Backoff, Clock
from coordinator.machine.runtime import Runtime
from coordinator.records import layout
from coordinator.records.records import Claim, Heartbeat, Manifest, NodeState, Session
from coordinator.storage.store import MemoryStore, publish_record

RUN = "abcdef012345"


class FakeClock(Clock):
    """Time moves only when the wait sleeps."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float, wake: object = None) -> bool:
        self.t += seconds
        return False


def beat(rank: int, token: str, counter: int, state: NodeState,
         session: str | None) -> Heartbeat:
    return Heartbeat(run_id=RUN, generation=0, rank=rank, token=token, host=f"gpu-0{rank}",
                     pid=1, counter=counter, state=state, iteration=2, phase=13,
                     waiting_for="", arrived=None, released=None, session=session,
                     resume_iteration=3, abort=None, error=None, wall_time=0.0)


def group(store: MemoryStore, num_nodes: int, rank: int, coord: CoordinationConfig,
          clock: Clock, state: NodeState) -> GroupForming:
    manifest = Manifest(run_id=RUN, generation=0, num_nodes=num_nodes, weights="auto",
                        config={}, config_hash="x", created=0.0)
    publish_record(store, layout.MANIFEST, manifest)
    runtime = Runtime()
    heartbeat = HeartbeatPublisher(store, base=beat(rank, f"t{rank}", 0, state, None),
                                   interval_s=coord.heartbeat_interval_s, runtime=runtime)
    return GroupForming(store=store, manifest=manifest, coord=coord, rank=rank,
                        token=f"t{rank}", host=f"gpu-0{rank}", run_dir=Path("/nonexistent/run"),
                        phases=[], iterations=5, heartbeat=heartbeat, runtime=runtime,
                        backoff=Backoff(initial_s=0.05, factor=1.5, ceiling_s=0.2),
                        clock=clock)


def test_a_shrunk_group_taking_ranks_back_names_its_own_deadline_and_no_restart(
        caplog: pytest.LogCaptureFixture) -> None:
    """The group of ranks 0 and 1 takes back the ranks that returned: it waits a lease
    and two beats (19 s by default), not rejoin_timeout_s (1800 s), and no master was
    restarted.  Both used to be what the wait said."""
    store = MemoryStore()
    coord = CoordinationConfig()
    publish_record(store, layout.SESSION, Session(
        run_id=RUN, generation=0, session="s1", start_iteration=0, end_iteration=5,
        members={"0": "t0", "1": "t1"}))
    clock = FakeClock()
    master = group(store, 3, 0, coord, clock, NodeState.RUNNING)
    with caplog.at_level(logging.INFO), pytest.raises(PeerLostError, match=(
            r"only 1 of 3 nodes are back after 19 s .* the shrunk group needs 2")):
        master.form(regroup.RecoveryLog(run_id=RUN, recoveries=()), incident=None,
                    started=None, previous=None, admit=True)
    after = coord.lease_s + 2 * coord.heartbeat_interval_s
    assert clock.t - 1000.0 == pytest.approx(after, abs=1.0)
    waits = [r.getMessage() for r in caplog.records if "to rejoin run" in r.getMessage()]
    assert waits, caplog.text
    for message in waits:
        assert "after: the shrunk group takes back the ranks that returned" in message
        assert f"waiting up to {after:g} s, then going on with the ranks back, at least 2 " \
            "(the shrunk group)" in message
        assert "restart of the master" not in message and "1800" not in message


@pytest.mark.parametrize("master_back", [False, True], ids=["no-master", "master-late"])
def test_a_worker_out_of_rejoin_time_names_the_rejoin_timeout(master_back: bool) -> None:
    """rejoin() gives each wait what is left of rejoin_timeout_s.  Running out in the
    wait for the session of a master that came back late said "gave up after 0 s
    waiting for the master to form the group" (exit 5), and with no master at all
    the wait's own timeout (exit 5); both are the group not back in time (exit 3)."""
    store = MemoryStore()
    coord = dataclasses.replace(CoordinationConfig(), rejoin_timeout_s=2.0)
    worker = group(store, 2, 1, coord, Clock(), NodeState.REGROUPING)
    stop = threading.Event()

    def restarted_master() -> None:  # back after 0.5 s, gathering until the test ends
        if stop.wait(0.5):
            return
        publish_record(store, layout.claim(0), Claim(
            run_id=RUN, generation=0, rank=0, token="new0", host="gpu-00",
            address="127.0.0.1", probe_port=None, pid=2, started=0.0))
        counter = 0
        while not stop.wait(0.1):
            counter += 1
            publish_record(store, layout.heartbeat(0),
                           beat(0, "new0", counter, NodeState.STARTING, None))

    master = threading.Thread(target=restarted_master, daemon=True)
    if master_back:
        master.start()
    started = time.monotonic()
    try:
        with pytest.raises(PeerLostError, match=(
                r"the group did not come back within coordination.rejoin_timeout_s=2 s")):
            worker.rejoin("s-old", "old0")
    finally:
        stop.set()
    # The one deadline, and not much past it (10 s: a loaded 2-core machine).
    assert 2.0 <= time.monotonic() - started < 10.0
