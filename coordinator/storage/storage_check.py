"""Whether a run directory can carry the protocol: every node asks at `coordinator run`'s start.

Two things the protocol cannot do without (PROTOCOL.md, filesystem
requirements), checked before anything is written:

    the mount's type   object-store FUSE mounts (rclone, s3fs, goofys, gcsfuse,
                       mountpoint-s3: coordinator/storage/mounts.py NO_ATOMIC_RENAME)
                       rename by copy and delete, so a reader can see half a file
    link(2)            the exclusive create of run.json and of every claim; such
                       mounts (blobfuse2 too) have no hard links and fail it (EIO)

A directory that fails either is refused on every node with exit 9
(UNSUITABLE_STORAGE), naming the mount, what it lacks and the fix: each node
refuses by itself, so no worker waits for a master that refused.
`coordinator doctor` reports the same mount risks with the measured lags.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from coordinator.errors import UnsuitableStorageError
from coordinator.storage import mounts

FIX = ("put the run directory on a filesystem every node mounts coherently, with atomic "
       "rename and hard links (NFS, Lustre, GPFS, CephFS, BeeGFS, JuiceFS); `coordinator "
       "doctor` checks a directory before a run")


def check_run_directory(path: Path, *, mountinfo: str | None = None) -> None:
    """UnsuitableStorageError when `path`'s filesystem cannot carry the protocol."""
    mount = mounts.mount_of(path, mountinfo)
    where = mount.describe() if mount is not None else "an unknown mount"
    if mount is not None:
        for risk in mounts.risks(mount, num_nodes=2):
            if risk.level is mounts.Level.FAIL:
                raise UnsuitableStorageError(
                    f"--run-dir {path} is on {where}: {risk.what}; the protocol publishes "
                    f"every file by an atomic rename: {FIX}", path=path)
    problem = _link_problem(path)
    if problem is not None:
        raise UnsuitableStorageError(
            f"--run-dir {path} is on {where}, where {problem}; the protocol creates run.json "
            f"and every claim with link(2), which must fail with EEXIST and nothing else: {FIX}",
            path=path)


def _link_problem(directory: Path) -> str | None:
    """Why a hard link cannot be made in `directory` (None: it can)."""
    name = f".link-test-{secrets.token_hex(6)}"
    source, target = directory / f"{name}.tmp", directory / f"{name}.link.tmp"
    try:
        fd = os.open(source, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        return f"a file cannot be created ({exc.strerror})"
    os.close(fd)
    try:
        os.link(source, target)
    except OSError as exc:
        return f"link(2) fails ({exc.strerror}, errno {exc.errno})"
    finally:
        for leftover in (target, source):
            with contextlib.suppress(OSError):  # best effort: the probe's own files
                os.unlink(leftover)
    return None
