"""`coordinator doctor`: prove that a run directory is shared and coherent among the nodes.

Started on every node the way `run` is; everything goes through <P>/doctor/:

    every worker node-<R>.json       its nonce, host, mount, free space, risks
                                     (re-published every second until the round names it)
    master       round.json          a fresh round id and every node's nonce: a node
                                     that reads its own nonce there knows the round is
                                     this one, not a file left by an earlier doctor
    worker       TCP to the master's probe port and a held "training" port
    master       probe s = 1..3K, K of each kind, one at a time:
                   replace   probe.json replaced by rename (the worker opens and reads it)
                   new       new-<round>-<s>.json created (the worker has been opening
                             that name since before it existed: a negative lookup cache
                             shows here)
                   list      list-<round>-<s>.json created (the worker lists the directory)
    worker       answer-<R>.json replaced by rename once it sees probe s
    master       round trip of each probe per rank, from publish to the answer seen
                 (publish-to-visible is about half of it); result.json with the verdict
    every node   prints the verdict table; exit 0, or 3 when a node could not see the
                 others (not shared, or not coherent within --timeout)

Clock skew is estimated from the answers' wall times (for information only:
the protocol never compares clocks).  Mount options are read from
/proc/self/mountinfo and explained by coordinator/storage/mounts.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from coordinator import routing
from coordinator.errors import MalformedRecordError, PeerLostError, WaitTimeout
from coordinator.machine import netaddr
from coordinator.machine.polling import Backoff, Wait
from coordinator.ops.doctor_verdict import (
    BUCKET,
    KINDS,
    LIST_WAIT_S,
    ROUNDS_PER_KIND,
    DoctorAnswer,
    DoctorNode,
    DoctorProbe,
    DoctorResult,
    DoctorRound,
    Probed,
    judge,
)
from coordinator.records.records import Record
from coordinator.storage import fsio, mounts
from coordinator.storage.store import FsStore, publish_record, read_record

log = logging.getLogger(__name__)

DIRECTORY: Final = "doctor"
@dataclasses.dataclass(kw_only=True)
class Doctor:
    run_dir: Path
    rank: int
    num_nodes: int | None  # the master's; a worker needs none
    timeout_s: float
    need_bytes: int
    address: str
    echo: Callable[[str], None]
    host: str = dataclasses.field(default_factory=socket.gethostname)
    mountinfo: str | None = None  # tests: a /proc/self/mountinfo to read instead
    nonce: str = dataclasses.field(default_factory=lambda: secrets.token_hex(8))

    def __post_init__(self) -> None:
        self.dir = self.run_dir / DIRECTORY
        self.store = FsStore(self.run_dir)
        self.backoff = Backoff(initial_s=0.005, factor=1.5, ceiling_s=0.2)

    # -- both sides -------------------------------------------------------------
    def run(self) -> bool:
        """This node's part; True when the directory can carry a run."""
        if routing.routed(self.run_dir) is not None:
            # A bucket (coordinator/storage/objstore.py): no mount, no free-space figure.
            self.mount = f"{BUCKET} {routing.display(self.run_dir)}"
            self.risks, self.free = [], 0
        else:
            mount = mounts.mount_of(self.run_dir, self.mountinfo)
            self.mount = mount.describe() if mount else "unknown (no /proc/self/mountinfo)"
            self.risks = mounts.risks(mount, num_nodes=self.num_nodes or 2) if mount else []
            self.free = shutil.disk_usage(self.run_dir).free
        if self.rank == 0:
            return self._master()
        return self._worker()

    def _key(self, name: str) -> str:
        return f"{DIRECTORY}/{name}"

    def _node(self) -> DoctorNode:
        return DoctorNode(rank=self.rank, nonce=self.nonce, host=self.host, pid=os.getpid(),
                          mount=self.mount, free_bytes=self.free, risks=tuple(self.risks))

    def _read(self, name: str, cls: type[Record]) -> Record | None:
        try:
            return read_record(self.store, self._key(name), cls, retry_s=0.2)
        except MalformedRecordError as exc:
            log.warning("ignoring %s", exc)
            return None

    def _wait(self, what: Callable[[], str], probe: Callable[[], object],
              deadline_s: float | None = None) -> object:
        return Wait(deadline_s=min(deadline_s or self.timeout_s, self.timeout_s),
                    backoff=self.backoff, progress_interval_s=5.0, describe=what).until(probe)

    # -- master -----------------------------------------------------------------
    def _master(self) -> bool:
        assert self.num_nodes is not None
        # An earlier doctor's files: nothing to trust there.  The workers' answer files
        # stay (an answer names its round, so an old one is ignored): unlinking them
        # would leave this client a cached failed lookup of each, and the first answer
        # of this round would show late for a reason that is not the filesystem's lag.
        fsio.ensure_dir(self.dir)
        for name in self.store.listdir(DIRECTORY):
            if not name.startswith("answer-"):
                fsio.remove_tree(self.dir / name)
        nodes: dict[int, DoctorNode] = {0: self._node()}
        missing = list(range(1, self.num_nodes))

        def gather() -> bool | None:
            for rank in list(missing):
                node = self._read(f"node-{rank}.json", DoctorNode)
                if isinstance(node, DoctorNode) and node.rank == rank:
                    nodes[rank] = node
                    missing.remove(rank)
            return True if not missing else None

        try:
            self._wait(lambda: f"node file(s) of rank(s) {missing} in {routing.display(self.dir)}", gather)
        except WaitTimeout:
            self._publish_result(False, [
                f"FAIL shared: rank(s) {missing} never appeared in {routing.display(self.dir)} within "
                f"{self.timeout_s:g} s: those nodes do not see this node's directory (it is not "
                "shared with them, or they cannot write it): check that --run-dir is the "
                "same network mount on every node"])
            return False
        server = netaddr.ProbeServer(self.address)
        train = netaddr.Listener(self.address)
        try:
            round_id = secrets.token_hex(6)
            # probe.json exists before any worker looks for it: its first replacement
            # then measures a replaced file, not a new one.
            publish_record(self.store, self._key("probe.json"),
                           DoctorProbe(round=round_id, seq=0))
            publish_record(self.store, self._key("round.json"), DoctorRound(
                round=round_id,
                nonces={str(r): n.nonce for r, n in nodes.items()}, address=self.address,
                probe_port=server.port, train_port=train.port))
            probed = self._probes(round_id)
            probed.exclusive = self._exclusive(round_id)
        finally:
            server.close()
            train.close()
        lines, ok = judge(nodes, probed, run_dir=self.run_dir, address=self.address,
                          need_bytes=self.need_bytes)
        self._publish_result(ok, lines, round_id)
        return ok

    def _probes(self, round_id: str) -> Probed:
        """The probes, one at a time, each answered by every worker."""
        assert self.num_nodes is not None
        out = Probed(trips={k: {} for k in KINDS})
        offsets: dict[int, list[tuple[float, float]]] = {}  # (round trip, offset)
        for seq in range(1, len(KINDS) * ROUNDS_PER_KIND + 1):
            kind = KINDS[(seq - 1) % len(KINDS)]
            started, wall = time.monotonic(), time.time()
            name = "probe.json" if kind == "replace" else f"{kind}-{round_id}-{seq}.json"
            publish_record(self.store, self._key(name), DoctorProbe(round=round_id, seq=seq))
            waiting = list(range(1, self.num_nodes))

            def answered(seq: int = seq, started: float = started, kind: str = kind,
                         waiting: list[int] = waiting, wall: float = wall) -> bool | None:
                for rank in list(waiting):
                    answer = self._read(f"answer-{rank}.json", DoctorAnswer)
                    if not (isinstance(answer, DoctorAnswer) and answer.round == round_id
                            and answer.seq >= seq):
                        continue
                    trip = time.monotonic() - started
                    trips = out.trips[kind].setdefault(rank, [])
                    if answer.listed:  # a list probe the listing did not show has no lag
                        trips.append(trip)
                    else:
                        out.unlisted[rank] = out.unlisted.get(rank, 0) + 1
                    out.reach[rank] = answer.reach
                    # It answered between our publish and our read: the midpoint; the
                    # shortest round trip is the least uncertain (as NTP takes it).
                    offsets.setdefault(rank, []).append(
                        (trip, answer.wall_time - (wall + trip / 2)))
                    out.clock_offset[rank] = min(offsets[rank])[1]
                    waiting.remove(rank)
                return True if not waiting else None

            def what(waiting: list[int] = waiting, kind: str = kind) -> str:
                return f"rank(s) {waiting} to see a {kind} probe"

            try:
                self._wait(what, answered)
            except WaitTimeout:
                out.failure = (f"rank(s) {waiting} did not see probe {seq} ({kind}) within "
                               f"{self.timeout_s:g} s")
                break
        return out

    def _exclusive(self, round_id: str) -> str:
        """Create one name twice: the second must be refused, or two masters could both
        create run.json (a bucket whose server ignores If-None-Match; a filesystem whose
        link(2) does not fail with EEXIST)."""
        key = self._key(f"exclusive-{round_id}.json")
        first = self.store.create_exclusive(key, b"{}")
        second = self.store.create_exclusive(key, b"{}")
        if first and not second:
            return ""
        return ("a first create was refused" if not first else
                "a second create of the same name succeeded: the storage does not honour "
                "exclusive creates (a conditional PUT, If-None-Match: *), so two masters "
                "could both create run.json; use a server that does (Azure Blob, GCS, S3 "
                "since 2024) or a POSIX filesystem")

    def _publish_result(self, ok: bool, lines: list[str], round_id: str = "") -> None:
        result = DoctorResult(round=round_id, ok=ok, lines=tuple(lines))
        publish_record(self.store, self._key("result.json"), result)
        self._print(result)

    def _print(self, result: DoctorResult) -> None:
        self.echo(f"doctor of {routing.display(self.run_dir)} (rank {self.rank} on {self.host}):")
        for line in result.lines:
            self.echo(f"  {line}")
        self.echo("verdict: " + ("the directory can carry a run" if result.ok else
                                 "the directory cannot carry a run (see FAIL above)"))

    # -- worker -----------------------------------------------------------------
    def _worker(self) -> bool:
        fsio.ensure_dir(self.dir)
        last = 0.0

        def named() -> DoctorRound | None:
            nonlocal last
            if time.monotonic() - last > 1.0:  # the master clears the directory at its start
                last = time.monotonic()
                try:
                    fsio.ensure_dir(self.dir)
                    # The answer file first: it exists before the master learns of this
                    # node, so the master's first read of it is never a failed lookup a
                    # client cache could keep.
                    publish_record(self.store, self._key(f"answer-{self.rank}.json"),
                                   DoctorAnswer(round="", rank=self.rank, seq=0,
                                                wall_time=time.time(), reach="", listed=True))
                    publish_record(self.store, self._key(f"node-{self.rank}.json"),
                                   self._node())
                except FileNotFoundError:
                    return None  # the master cleared the directory under the rename: again
            found = self._read("round.json", DoctorRound)
            if isinstance(found, DoctorRound) and found.nonces.get(str(self.rank)) == self.nonce:
                return found
            return None

        try:
            round_ = self._wait(lambda: f"the master's round naming this node in {routing.display(self.dir)}",
                                named)
        except WaitTimeout:
            self._print(DoctorResult(round="", ok=False, lines=(
                f"FAIL shared: no round from the master naming rank {self.rank} appeared in "
                f"{routing.display(self.dir)} within {self.timeout_s:g} s: this node does not see the "
                "master's directory (not shared, or the master is not running doctor)",)))
            return False
        assert isinstance(round_, DoctorRound)
        reach = self._reach(round_)
        for seq in range(1, len(KINDS) * ROUNDS_PER_KIND + 1):
            kind = KINDS[(seq - 1) % len(KINDS)]
            def what(seq: int = seq, kind: str = kind) -> str:
                return f"probe {seq} ({kind}) from the master"

            def sees(seq: int = seq, kind: str = kind) -> bool | None:
                return self._sees(round_.round, seq, kind)

            listed = True
            try:
                self._wait(what, sees, LIST_WAIT_S if kind == "list" else None)
            except WaitTimeout:
                if kind != "list":
                    break  # the master reports it; its result says why
                listed = False
            following = KINDS[seq % len(KINDS)]
            if following == "new" and seq < len(KINDS) * ROUNDS_PER_KIND:
                # Look the next new file up before the master can create it, as a waiter
                # polling for a file does: a cache of failed lookups then shows.
                self._sees(round_.round, seq + 1, "new")
            publish_record(self.store, self._key(f"answer-{self.rank}.json"), DoctorAnswer(
                round=round_.round, rank=self.rank, seq=seq, wall_time=time.time(),
                reach=reach, listed=listed))
        try:
            result = self._wait(lambda: "the master's verdict", lambda: self._result(round_))
        except WaitTimeout:
            raise PeerLostError(f"the master published no verdict within {self.timeout_s:g} s",
                                rank=0) from None
        assert isinstance(result, DoctorResult)
        self._print(result)
        return result.ok

    def _sees(self, round_id: str, seq: int, kind: str) -> bool | None:
        if kind == "replace":
            probe = self._read("probe.json", DoctorProbe)
            return True if isinstance(probe, DoctorProbe) and probe.round == round_id and \
                probe.seq >= seq else None
        name = f"{kind}-{round_id}-{seq}.json"
        if kind == "new":
            return True if self._read(name, DoctorProbe) is not None else None
        return True if name in self.store.listdir(DIRECTORY) else None

    def _result(self, round_: DoctorRound) -> DoctorResult | None:
        found = self._read("result.json", DoctorResult)
        return found if isinstance(found, DoctorResult) and found.round == round_.round \
            else None

    def _reach(self, round_: DoctorRound) -> str:
        problems = []
        for what, port in (("probe", round_.probe_port), ("training", round_.train_port)):
            try:
                netaddr.probe(round_.address, port, timeout_s=5.0)
            except OSError as exc:
                problems.append(f"cannot connect to the master's {what} port "
                                f"{round_.address}:{port} ({exc}): open it in the firewall or "
                                "pass --node-ip / --ifname to the master")
        return "; ".join(problems)
