"""What `coordinator doctor` publishes and measures, and how its master judges it.

The records of a round (coordinator/ops/doctor.py runs it: every node's
`node-<R>.json`, the master's `round.json` and probes, the workers' answers,
`result.json`), what the probes measured (`Probed`), and `judge`: measurements
to the verdict table every node prints, with each slow lag's likely cause and fix.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path
from typing import ClassVar, Final

from coordinator import routing
from coordinator.records.bounds import check_rank
from coordinator.records.records import Record
from coordinator.storage import mounts

BUCKET: Final = "bucket"  # how a node's mount reads when the run directory is one
KINDS: Final = ("replace", "new", "list")
ROUNDS_PER_KIND: Final = 2
# Listings are hints (PROTOCOL.md rule 4): a worker waits this long for a new name
# to show in one, then answers anyway (FUSE and NFS cache listings for 30-60 s).
LIST_WAIT_S: Final = 1.0
# A lag above this shows in the verdict: joins and barriers will feel it.
SLOW_LAG_S: Final = 1.0
SLOW_FIX: Final = {
    "new": "a file another node creates shows late here: failed lookups are cached (NFS "
           "lookupcache=all, the default: mount with lookupcache=positive; FUSE: "
           "negative_timeout=0)",
    "replace": "a file replaced on another node shows late: attributes or data are cached (NFS: "
               "actimeo of 60 or less, no nocto; FUSE: direct_io or a lower attr_timeout)",
    "list": "directory listings show new files late (NFS acdirmax, FUSE directory caches): the "
            "protocol never relies on listings, information only",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DoctorNode(Record):
    SCHEMA: ClassVar[str] = "coordinator/doctor-node"
    rank: int
    nonce: str
    host: str
    pid: int
    mount: str
    free_bytes: int
    risks: tuple[mounts.Risk, ...]

    def __post_init__(self) -> None:
        check_rank(self.rank)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DoctorRound(Record):
    SCHEMA: ClassVar[str] = "coordinator/doctor-round"
    round: str
    nonces: dict[str, str]  # rank -> the nonce its node published
    address: str
    probe_port: int
    train_port: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class DoctorProbe(Record):
    SCHEMA: ClassVar[str] = "coordinator/doctor-probe"
    round: str
    seq: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class DoctorAnswer(Record):
    SCHEMA: ClassVar[str] = "coordinator/doctor-answer"
    round: str
    rank: int
    seq: int
    wall_time: float
    reach: str  # "" when the master's ports answered, else what failed
    listed: bool  # a list probe: whether the listing showed the file in LIST_WAIT_S


@dataclasses.dataclass(frozen=True, kw_only=True)
class DoctorResult(Record):
    SCHEMA: ClassVar[str] = "coordinator/doctor-result"
    round: str
    ok: bool
    lines: tuple[str, ...]  # the verdict table, one line per check


@dataclasses.dataclass(kw_only=True)
class Probed:
    """What the master's probes measured, per kind and rank."""

    trips: dict[str, dict[int, list[float]]]  # round trips, in seconds
    reach: dict[int, str] = dataclasses.field(default_factory=dict)  # "" or what failed
    clock_offset: dict[int, float] = dataclasses.field(default_factory=dict)  # seconds
    # Per rank: list probes it answered whose file its listing did not show in time.
    unlisted: dict[int, int] = dataclasses.field(default_factory=dict)
    failure: str = ""  # a probe not seen in time (the probes after it were not made)
    exclusive: str = ""  # what went wrong with the exclusive create, or ""



def judge(nodes: dict[int, DoctorNode], probed: Probed, *, run_dir: Path, address: str,
          need_bytes: int) -> tuple[list[str], bool]:
    """The verdict lines of a round and whether the directory can carry a run."""
    ok = not probed.failure
    lines = [f"{'OK  ' if ok else 'FAIL'} shared: {len(nodes)} node(s) see each other's "
             f"files in {routing.display(run_dir)}"
             + (f"; {probed.failure}" if probed.failure else "")]
    for kind in KINDS:
        for rank, values in sorted(probed.trips[kind].items()):
            unlisted = probed.unlisted.get(rank, 0) if kind == "list" else 0
            if unlisted:
                lines.append(f"INFO {kind:<7} rank {rank} ({nodes[rank].host}): "
                             f"{unlisted} of {unlisted + len(values)} new files did not "
                             f"show in a listing within {LIST_WAIT_S:g} s; "
                             f"{SLOW_FIX['list']}")
            if not values:
                continue
            lag = statistics.median(values) / 2
            # A new file: one late probe is the cache of failed lookups at work.
            slow = (max(values) if kind == "new" else statistics.median(values)) / 2 \
                > SLOW_LAG_S
            status = ("INFO" if kind == "list" else "WARN") if slow else "OK  "
            lines.append(f"{status} {kind:<7} rank {rank} ({nodes[rank].host}): "
                         f"publish-to-visible ~{lag * 1000:.0f} ms (round trips "
                         + ", ".join(f"{v * 1000:.0f}" for v in values) + " ms)"
                         + (f"; {SLOW_FIX[kind]}" if slow else ""))
    if probed.exclusive:
        ok = False
        lines.append(f"FAIL exclusive create: {probed.exclusive}")
    elif not probed.failure:
        lines.append("OK   exclusive create: a second create of the same name is refused "
                     "(run.json and the rank claims rely on it)")
    for rank, reach in sorted(probed.reach.items()):
        if reach:
            ok = False
            lines.append(f"FAIL network rank {rank} ({nodes[rank].host}): {reach}")
        else:
            lines.append(f"OK   network rank {rank} ({nodes[rank].host}) reaches the "
                         f"master's address {address} and a held training port")
        lines.append(f"INFO clock   rank {rank} ({nodes[rank].host}): about "
                     f"{probed.clock_offset[rank]:+.3f} s from the master's clock "
                     "(information only: the protocol never compares clocks)")
    for rank, node in sorted(nodes.items()):
        lines.append(f"INFO mount   rank {rank} ({node.host}): {node.mount}")
        for risk in node.risks:
            lines.append(f"{risk.level.value.upper():<4} mount   rank {rank}: "
                         f"{risk.what}; fix: {risk.fix}")
            ok = ok and risk.level is not mounts.Level.FAIL
        if node.mount.startswith(f"{BUCKET} "):
            lines.append(f"INFO space   rank {rank}: a bucket has no free-space figure "
                         "(its quota, if any, is the cloud account's)")
            continue
        enough = node.free_bytes >= need_bytes
        lines.append(f"{'OK  ' if enough else 'WARN'} space   rank {rank}: "
                     f"{_gib(node.free_bytes, enough)} GiB free in the run directory"
                     + ("" if enough else f", below the {need_bytes / 2**30:g} GiB "
                        "asked for (--need-gb): checkpoints and trajectories may not fit"))
    return lines, ok


def _gib(free: int, enough: bool) -> str:
    """Free space in GiB to one decimal; rounded down when short of the need, so that
    19.96 GiB against 20 reads 19.9, never a 20.0 that would seem to meet it."""
    tenths = free / 2**30 * 10
    return f"{(round(tenths) if enough else math.floor(tenths)) / 10:.1f}"
