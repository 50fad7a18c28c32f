"""Taking over a dead holder's claim is a compare-and-swap (coordinator/machine/claims.py).

Two daemons (threads here, each with its own view of one real store) both judge
a claim's holder dead; the interleaving that used to let both run is forced at
the exact call with a gate in the store: one daemon's first write after it read
the claim waits until the test lets it go.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.errors import RankHeldError
from coordinator.machine import membership
from coordinator.machine.claims import Refused, after_refused_marker
from coordinator.machine.liveness import HeartbeatPublisher
from coordinator.machine.polling import Backoff, Clock
from coordinator.machine.runtime import Runtime
from coordinator.records import layout
from coordinator.records.records import Claim, NodeState
from coordinator.storage.store import FsStore, MemoryStore, Store, read_record
from tests.support.cluster import LocalCluster, write_config

RUN = "0123456789ab"
BEAT_S = 0.05
# How long a daemon watches a holder without a heartbeat of its token before it
# judges it dead; the live ones here beat 40 times a lease.
LEASE_S = 1.0
BACKOFF = Backoff(initial_s=0.01, factor=2.0, ceiling_s=0.1)
# A gated call or a judged daemon waits at most this long: seconds are needed,
# the rest is room for a loaded 2-core machine.
WAIT_S = 30.0


def claim(token: str, host: str, pid: int) -> Claim:
    return Claim(run_id=RUN, generation=0, rank=1, token=token, host=host,
                 address="127.0.0.1", probe_port=None, pid=pid, started=1.0e9)


DEAD = claim("dead0000", "node-x", 1111)
A = claim("aaaa0000", "node-a", 4242)
B = claim("bbbb0000", "node-b", 4343)
KEY = layout.claim(1)


class Gated:
    """The real store, except that the first of `verbs` called once the claim was
    read waits until `go` is set (`held` says it is waiting)."""

    def __init__(self, inner: Store, verbs: tuple[str, ...]) -> None:
        self.inner, self.verbs = inner, verbs
        if isinstance(inner, FsStore):
            self.root = inner.root  # read_record names files by it
        self.seen_claim = False
        self.used = False
        self.held, self.go = threading.Event(), threading.Event()

    def _gate(self, verb: str) -> None:
        if self.seen_claim and not self.used and verb in self.verbs:
            self.used = True
            self.held.set()
            assert self.go.wait(WAIT_S), f"the test never let {verb} go"

    def publish(self, key: str, data: bytes) -> None:
        self._gate("publish")
        self.inner.publish(key, data)

    def read(self, key: str, *, fresh: bool = False) -> bytes | None:
        data = self.inner.read(key, fresh=fresh)
        self.seen_claim = self.seen_claim or key == KEY
        return data

    def create_exclusive(self, key: str, data: bytes) -> bool:
        self._gate("create_exclusive")
        return self.inner.create_exclusive(key, data)

    def remove(self, key: str) -> bool:
        self._gate("remove")
        return self.inner.remove(key)

    def rename(self, src: str, dst: str) -> None:
        self._gate("rename")
        self.inner.rename(src, dst)

    def listdir(self, key: str) -> list[str]:
        return self.inner.listdir(key)


def take(store: Store, who: Claim) -> None:
    membership.claim_rank(store, who, lease_s=LEASE_S, clock=Clock(), retry_s=1.0,
                          backoff=BACKOFF, progress_interval_s=60.0)


def in_thread(fn: Callable[[], None]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            fn()
            out["took"] = True
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def beating(store: Store, who: Claim, *, fenced: bool) -> HeartbeatPublisher:
    """`who`'s heartbeat, as the daemon starts it once it holds the claim; `fenced`:
    re-reading the claim every 5 beats, as the daemon does."""
    publisher = HeartbeatPublisher.starting(store, who, resume_iteration=0, interval_s=BEAT_S,
                                            runtime=Runtime(), retry_s=1.0)
    if not fenced:
        publisher.fence = None
    publisher.start()
    return publisher


@pytest.fixture(params=["filesystem", "memory",
                        pytest.param("bucket", marks=pytest.mark.slow)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    made: Store
    if request.param == "bucket":
        # S3 (moto's server): the exclusive creates are conditional PUTs
        # (If-None-Match: *), a rename is a copy and a delete.
        made = request.getfixturevalue("moto").bucket("claims").store
    else:
        made = FsStore(tmp_path) if request.param == "filesystem" else MemoryStore()
    # The holder failed: its heartbeat says so, and its claim is still there.
    assert made.create_exclusive(KEY, DEAD.to_bytes())
    HeartbeatPublisher.starting(made, DEAD, resume_iteration=0, interval_s=BEAT_S,
                                runtime=Runtime(), retry_s=1.0).beat(
        state=NodeState.FAILED, error="a step failed")
    yield made


def holder(store: Store) -> Claim | None:
    return read_record(store, KEY, Claim, retry_s=1.0)


def test_of_two_daemons_that_judged_the_holder_dead_the_second_exits_naming_the_first(
        store: Store) -> None:
    gated = Gated(store, ("create_exclusive", "rename"))
    second, out = in_thread(lambda: take(gated, B))
    assert gated.held.wait(WAIT_S), out  # B found it dead
    take(store, A)  # A found it dead too, and took its place
    a_beat = beating(store, A, fenced=True)
    try:
        gated.go.set()  # B acts on its judgment now
        second.join(WAIT_S)
        assert not second.is_alive()
        error = out.get("error")
        assert isinstance(error, RankHeldError), out
        assert error.pid == A.pid and error.host == A.host
        assert "rank 1 of run 0123456789ab is already held by pid 4242 on host node-a" in \
            str(error)
        # A runs on: its claim is in place through its fence checks (every 5 beats).
        start = a_beat.record.counter
        deadline = threading.Event()
        while a_beat.record.counter < start + 12 and not deadline.wait(BEAT_S):
            pass
        assert a_beat.runtime.failure is None
        current = holder(store)
        assert current is not None and current.token == A.token
        aside = read_record(store, layout.claim_stale(1, DEAD.token), Claim, retry_s=1.0)
        assert aside == DEAD
    finally:
        a_beat.stop()


def test_a_taker_frozen_for_a_lease_is_replaced_and_on_waking_gives_way_naming_the_winner(
        store: Store) -> None:
    gated = Gated(store, ("rename",))
    first, out = in_thread(lambda: take(gated, A))
    # A made the marker of the dead claim and froze before setting it aside.
    assert gated.held.wait(WAIT_S), out
    assert store.read(layout.claim_taken(1, DEAD.token)) == A.to_bytes()
    take(store, B)  # B judged A dead (no heartbeat of its own for a lease) and took its place
    assert store.read(layout.claim_taken(1, A.token)) == B.to_bytes()
    # Without its fence checks: whether one fell in the instant A held B's claim
    # aside is luck; the claim left in place is not.
    b_beat = beating(store, B, fenced=False)
    try:
        gated.go.set()  # A wakes and renames what it takes for the dead claim
        first.join(WAIT_S)
        assert not first.is_alive()
        error = out.get("error")
        assert isinstance(error, RankHeldError), out
        assert "is already held by pid 4343 on host node-b" in str(error)
        current = holder(store)
        assert current is not None and current.token == B.token
    finally:
        b_beat.stop()


def test_a_second_daemon_meeting_a_takeover_in_progress_names_its_taker(store: Store) -> None:
    gated = Gated(store, ("rename",))
    first, out_a = in_thread(lambda: take(gated, A))
    assert gated.held.wait(WAIT_S), out_a
    # A is alive (it beats) but has not replaced the claim yet.
    a_beat = beating(store, A, fenced=False)
    try:
        with pytest.raises(RankHeldError, match=r"rank 1 of run 0123456789ab is being taken "
                           r"over by pid 4242 on host node-a .*which found its dead holder "
                           r"\(pid 1111 on host node-x\) first"):
            take(store, B)
        gated.go.set()
        first.join(WAIT_S)
        assert out_a == {"took": True}
        current = holder(store)
        assert current is not None and current.token == A.token
    finally:
        a_beat.stop()


def test_what_a_refused_marker_means() -> None:
    current_dead = DEAD
    assert after_refused_marker(own=B.token, judged=DEAD.token, current=current_dead,
                                taker=A) is Refused.JUDGE_TAKER
    # Our own conditional PUT, retried after its answer was lost, refused itself.
    assert after_refused_marker(own=A.token, judged=DEAD.token, current=current_dead,
                                taker=A) is Refused.OURS
    # The taker finished (the claim is its own now), the holder released it, or
    # the marker went (`recover`): judge afresh.
    for current, taker in ((A, A), (None, A), (DEAD, None)):
        assert after_refused_marker(own=B.token, judged=DEAD.token, current=current,
                                    taker=taker) is Refused.AGAIN


def test_a_hostile_token_never_shapes_a_path() -> None:
    assert layout.claim_taken(1, "aaaa0000") == "ranks/1/claim.taken-aaaa0000.json"
    for token in ("../../etc/passwd", "a/b", "..", "", "x" * 65):
        name = layout.claim_taken(1, token)
        assert name.startswith("ranks/1/claim.taken-sha256-") and name.count("/") == 2
        assert layout.claim_stale(1, token).startswith("ranks/1/claim.stale-sha256-")


# A worker daemon whose first judgment of a claim's holder, once made, waits for a
# byte on stdin before the daemon acts on it: the exact call, in the real process.
GATED_WORKER = (
    "import os, sys\n"
    "from coordinator.machine import claims\n"
    "real = claims.holder_alive\n"
    "gated = []\n"
    "def judged(store, claim, **kw):\n"
    "    alive = real(store, claim, **kw)\n"
    "    if not gated:\n"
    "        gated.append(claim)\n"
    "        os.write(1, f'judged {claim.token} alive={alive}\\n'.encode())\n"
    "        os.read(0, 1)\n"
    "    return alive\n"
    "claims.holder_alive = judged\n"
    "from coordinator_cli.app import main\n"
    "sys.argv = ['coordinator'] + sys.argv[1:]\n"
    "main()\n"
)
DAEMON_S = 90.0  # a 2-iteration scripted run with 1 s phases: seconds; room for a loaded box


class GatedWorker:
    def __init__(self, c: LocalCluster, out: Path) -> None:
        self.out = out
        with open(out, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", GATED_WORKER, "run", "--worker", "1", "--run-dir",
                 str(c.run_dir)], stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                env=c.env)

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_judged(self, c: LocalCluster, token: str) -> None:
        c.wait_until(lambda: f"judged {token} alive=False" in self.text()
                     or self.proc.poll() is not None, DAEMON_S,
                     f"{self.out.name} to judge the holder dead")
        assert self.proc.poll() is None, self.text()[-3000:]

    def open_gate(self) -> None:
        assert self.proc.stdin is not None
        os.write(self.proc.stdin.fileno(), b"g")


@pytest.mark.slow
def test_two_restarted_daemons_that_judged_the_holder_dead_one_runs_the_other_exits_naming_it(
        tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", iterations=2, scripted='sleeps = ["*:*:1:1.0"]')
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=2, config=config)
    workers: list[GatedWorker] = []
    try:
        c.start(0)
        c.wait_until(lambda: (c.run_dir / "run.json").exists() or c.procs[0].poll() is not None,
                     DAEMON_S, "the run manifest")
        assert c.procs[0].poll() is None, c.output(0)[-3000:]
        manifest = json.loads((c.run_dir / "run.json").read_text())
        # Rank 1's last holder failed: its claim is still there, its heartbeat says so.
        store = FsStore(c.run_dir)
        dead = Claim(run_id=manifest["run_id"], generation=manifest["generation"], rank=1,
                     token="dead0000", host="node-x", address="127.0.0.1", probe_port=None,
                     pid=1111, started=time.time())
        assert store.create_exclusive(KEY, dead.to_bytes())
        HeartbeatPublisher.starting(store, dead, resume_iteration=0, interval_s=0.5,
                                    runtime=Runtime(), retry_s=1.0).beat(
            state=NodeState.FAILED, error="a step failed")
        # Two restarts of rank 1 both find it dead; the second's gate opens last.
        second = GatedWorker(c, tmp_path / "second.log")
        workers.append(second)
        second.wait_judged(c, dead.token)
        first = GatedWorker(c, tmp_path / "first.log")
        workers.append(first)
        first.wait_judged(c, dead.token)
        first.open_gate()
        c.wait_until(lambda: (holder(store) or dead).pid == first.proc.pid, DAEMON_S,
                     "the first to take rank 1 over")
        second.open_gate()
        try:
            code = second.proc.wait(timeout=DAEMON_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the second ran on: {second.text()[-3000:]}") from None
        assert code == 2, second.text()[-3000:]
        assert f"already held by pid {first.proc.pid} on host" in second.text(), \
            second.text()[-3000:]
        assert first.proc.wait(timeout=DAEMON_S) == 0, first.text()[-3000:]
        assert c.wait(0, DAEMON_S) == 0, c.output(0)[-3000:]
        assert "taking over rank 1 from a dead holder" in first.text()
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
            w.proc.wait(timeout=30)
        c.close()
