"""The mount a path lives on, from /proc/self/mountinfo, and what its options risk.

    mountinfo line: ID PARENT MAJ:MIN ROOT MOUNTPOINT MOUNT-OPTS [OPTIONAL...] - TYPE SOURCE SUPER-OPTS

`mount_of` finds the longest mount point containing a path.  `risks` explains
the options that matter to a run directory shared between nodes, each with its
fix (`coordinator doctor` prints them).  The protocol is correct on all of
these (PROTOCOL.md, filesystem requirements): what they cost is time, or, for
the few marked FAIL, the atomic rename every published file relies on.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from pathlib import Path
from typing import ClassVar, Final

from coordinator.records.records import Record

_OCTAL: Final = re.compile(r"\\([0-7]{3})")  # mountinfo escapes space, tab, newline, backslash

# Filesystems that live on one host: inotify events are complete there.
LOCAL_FILESYSTEMS: Final = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs", "overlay", "zfs", "f2fs"})
# Object-store FUSE mounts: rename is a copy and a delete, never atomic.
NO_ATOMIC_RENAME: Final = frozenset(
    {"fuse.s3fs", "fuse.goofys", "fuse.gcsfuse", "fuse.mountpoint-s3", "fuse.rclone"})
COHERENT: Final = frozenset({"lustre", "gpfs", "beegfs", "cephfs", "ceph", "wekafs", "fuse.juicefs"})
ATTRIBUTE_CACHE_KEYS: Final = ("actimeo", "acregmax", "acdirmax")
LONG_ATTRIBUTE_CACHE_S: Final = 60


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mount:
    mount_point: str
    fs_type: str
    source: str
    options: tuple[str, ...]  # per-mount and superblock options, in order

    def option(self, key: str) -> str | None:
        """The value of `key=value` (or "" for a bare flag), None when absent."""
        for opt in self.options:
            name, _, value = opt.partition("=")
            if name == key:
                return value
        return None

    def describe(self) -> str:
        return f"{self.fs_type} {self.source} on {self.mount_point} ({','.join(self.options)})"


class Level(str, enum.Enum):
    INFO = "info"
    WARN = "warn"
    FAIL = "fail"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Risk(Record):
    """What a mount's type or option risks, and the fix (doctor-node records carry it)."""

    SCHEMA: ClassVar[str] = "coordinator/mount-risk"
    level: Level
    what: str
    fix: str


def _unescape(text: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), text)


def parse(mountinfo: str) -> list[Mount]:
    mounts = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < 6:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 3:
            continue
        options = tuple(fields[5].split(",")) + tuple(
            o for o in (fields[sep + 3].split(",") if len(fields) > sep + 3 else [])
            if o not in fields[5].split(","))
        mounts.append(Mount(mount_point=_unescape(fields[4]), fs_type=fields[sep + 1],
                            source=_unescape(fields[sep + 2]), options=options))
    return mounts


def mount_of(path: Path, mountinfo: str | None = None) -> Mount | None:
    """The mount holding `path` (the longest mount point containing it), if known."""
    try:
        text = mountinfo if mountinfo is not None else Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    target = os.path.realpath(path)
    best: Mount | None = None
    for mount in parse(text):
        point = mount.mount_point
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.mount_point)):
            best = mount
    return best


def filesystem_type(path: Path, mountinfo: str | None = None) -> str:
    """The type of the filesystem holding `path` ("" if unknown)."""
    mount = mount_of(path, mountinfo)
    return mount.fs_type if mount is not None else ""


def risks(mount: Mount, *, num_nodes: int) -> list[Risk]:
    """What this mount's type and options mean for a run directory shared by nodes."""
    kind = mount.fs_type
    out: list[Risk] = []
    if kind in ("nfs", "nfs4"):
        lookup = mount.option("lookupcache")
        if lookup not in ("none", "pos", "positive"):
            out.append(Risk(
                level=Level.WARN,
                what="NFS caches negative lookups (lookupcache=all, the default): a file another "
                     "node creates can stay invisible here for up to acdirmax (60 s by default)",
                fix="mount with lookupcache=positive (or none); the protocol opens only files "
                    "their writer has announced, so runs stay correct, but joins and "
                    "`doctor` wait out the cache"))
        if mount.option("nocto") is not None:
            out.append(Risk(
                level=Level.WARN,
                what="nocto: open() does not revalidate, so a file replaced by rename on "
                     "another node can be read stale",
                fix="remove nocto (close-to-open consistency is what rule 1 of PROTOCOL.md "
                    "relies on)"))
        for key in ATTRIBUTE_CACHE_KEYS:
            value = mount.option(key)
            if value and value.isdigit() and int(value) > LONG_ATTRIBUTE_CACHE_S:
                out.append(Risk(
                    level=Level.WARN,
                    what=f"{key}={value}: attributes cached for up to {value} s, so changes "
                         "made on other nodes show late",
                    fix=f"use {key}={LONG_ATTRIBUTE_CACHE_S} or less (the default is 60)"))
    elif kind == "fuse.blobfuse2":
        out.append(Risk(
            level=Level.WARN,
            what="blobfuse2: with its file_cache component a file is served from the local "
                 "cache until file-cache-timeout, so another node's new version shows late",
            fix="use the block_cache component, or file-cache-timeout 0, for the run "
                "directory"))
    elif kind in NO_ATOMIC_RENAME:
        out.append(Risk(
            level=Level.FAIL,
            what=f"{kind} is an object store: rename copies then deletes, so a reader can see "
                 "a half-written file under its final name",
            fix="put the run directory on NFS, Lustre, GPFS or CephFS"))
    elif kind.startswith("fuse."):
        out.append(Risk(
            level=Level.INFO,
            what=f"{kind}: a FUSE filesystem; its caching decides how fast other nodes' "
                 "files show (the doctor measures it)",
            fix="if the measured lags are long, turn the filesystem's client caches down"))
    elif kind in LOCAL_FILESYSTEMS and num_nodes > 1:
        out.append(Risk(
            level=Level.INFO,
            what=f"{kind} is a local filesystem: shared only if every node runs on this host",
            fix="the 'shared' check proves whether the nodes see each other's files"))
    elif kind in COHERENT:
        out.append(Risk(level=Level.INFO, what=f"{kind}: a coherent cluster filesystem",
                        fix="nothing to do"))
    return out
