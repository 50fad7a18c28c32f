"""Exceptions of the coordinator and the exit codes they map to.

Every error carries the facts an operator needs at 3 a.m. as attributes
(rank, host, phase, iteration, path) and a message that names the value, the
rule and the fix.  `ExitCode` is documented in docs/PROTOCOL.md.
"""

from __future__ import annotations

import enum
import errno
import os
import re
from pathlib import Path
from typing import Final

from coordinator import routing


class ExitCode(enum.IntEnum):
    OK = 0
    INTERNAL = 1
    USAGE = 2
    PEER_LOST = 3
    PHASE_FAILED = 4
    TIMEOUT = 5
    FENCED = 6
    CORRUPT = 7
    STORAGE = 8
    UNSUITABLE_STORAGE = 9
    BUCKET_UNUSABLE = 10
    INTERRUPTED = 130


EXIT_CODE_MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "every iteration completed (or the run was already complete, or it completed "
                 "while this rank waited to be taken back into a shrunk group)",
    ExitCode.INTERNAL: "an unexpected error; the message and traceback say where",
    ExitCode.USAGE: "a bad flag or config value (on a worker waiting for its master, the "
                    "master's: it refused them at start), or the rank is already held by a live "
                    "daemon",
    ExitCode.PEER_LOST: "a rank was lost (lease expired), left, or was restarted under us",
    ExitCode.PHASE_FAILED: "an action failed on some rank, or the master aborted the iteration",
    ExitCode.TIMEOUT: "a wait passed its deadline",
    ExitCode.FENCED: "this daemon is superseded: the generation was bumped or its claim was taken",
    ExitCode.CORRUPT: "a file in the run directory is corrupt, out of range or not a plain "
    "file (a symlink, FIFO, device, directory or oversized); the message names it",
    ExitCode.STORAGE: "the shared filesystem refused a write during the run (no space, "
    "quota, read-only, permission); the message names the path and the errno (a run "
    "directory this user cannot write at all is refused at start: exit 2)",
    ExitCode.UNSUITABLE_STORAGE: "the run directory's filesystem cannot carry the protocol "
    "(an object-store FUSE mount: no atomic rename, no link(2)); every node refuses at start, "
    "naming the mount, what it lacks and the fix",
    ExitCode.BUCKET_UNUSABLE: "the run directory's bucket cannot be used: wrong or missing "
    "credentials, no such container or bucket, or the server cannot be reached; the message "
    "names the URL and the cause, never a credential",
    ExitCode.INTERRUPTED: "SIGINT or SIGTERM; the daemon published that it left",
}


class CoordinatorError(Exception):
    """Root of every error this package raises on purpose."""

    exit_code: ExitCode = ExitCode.INTERNAL


class UsageError(CoordinatorError, ValueError):
    """A bad flag or configuration value; the message names it and the fix."""

    exit_code = ExitCode.USAGE


class RankHeldError(CoordinatorError):
    """Another live daemon holds this rank."""

    exit_code = ExitCode.USAGE

    def __init__(self, message: str, *, rank: int, host: str, pid: int) -> None:
        super().__init__(message)
        self.rank, self.host, self.pid = rank, host, pid


class MalformedRecordError(CoordinatorError, ValueError):
    """A file in the run directory is not a valid record of its schema."""

    exit_code = ExitCode.CORRUPT

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{routing.display(path)}: {problem}")
        self.path, self.problem = path, problem


class UnsafeFileError(MalformedRecordError):
    """A path in the run directory is a symlink, FIFO, device, directory or oversized file.

    Such a file is never opened for its content, written through or followed:
    whoever planted it cannot make a daemon hang, read without end, or write
    outside the run directory.
    """


class IntegrityError(MalformedRecordError):
    """A file's size or SHA-256 differs from what its manifest recorded.

    Corruption, not an I/O error: an I/O error stays an OSError, so that work
    is redone only when its output is known to be bad.
    """


class StorageError(CoordinatorError):
    """The shared filesystem refused a write for a reason retrying will not fix."""

    exit_code = ExitCode.STORAGE

    def __init__(self, path: Path | str, errno_: int, strerror: str) -> None:
        name = errno.errorcode.get(errno_, str(errno_))
        fix = STORAGE_FIXES.get(errno_, "fix the filesystem")
        super().__init__(
            f"cannot write {routing.display(path)}: {strerror} ({name}): {fix}, then run "
            "`coordinator recover` and restart every node")
        self.errno, self.strerror = errno_, strerror
        self.path = Path(path)


class BucketError(CoordinatorError):
    """A bucket run directory cannot be used (coordinator/storage/objstore.py); no credential in it."""

    exit_code = ExitCode.BUCKET_UNUSABLE


class UnsuitableStorageError(CoordinatorError):
    """The run directory's filesystem lacks what the protocol relies on (storage_check.py)."""

    exit_code = ExitCode.UNSUITABLE_STORAGE

    def __init__(self, message: str, *, path: Path) -> None:
        super().__init__(message)
        self.path = path


# Errors of a write that no retry within a deadline will cure.
STORAGE_FIXES: dict[int, str] = {
    errno.ENOSPC: "free space on the shared filesystem",
    errno.EDQUOT: "raise the quota or free space on the shared filesystem",
    errno.EROFS: "remount the shared filesystem read-write",
    errno.EACCES: "give this user write permission on the run directory",
    errno.EPERM: "give this user write permission on the run directory",
    errno.EFBIG: "the file exceeds the filesystem's size limit; free space or split the data",
}


def storage_error(exc: BaseException, path: Path | str | None = None) -> StorageError | None:
    """The StorageError an OSError amounts to, or None when it is not one."""
    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, OSError) and exc.errno in STORAGE_FIXES:
        where = path if path is not None else (exc.filename or "the run directory")
        return StorageError(where, exc.errno, exc.strerror or os.strerror(exc.errno))
    return None


class WaitTimeout(CoordinatorError, TimeoutError):
    """A wait passed its deadline; the message says what it waited for."""

    exit_code = ExitCode.TIMEOUT


class PeerLostError(CoordinatorError):
    """A rank this daemon needs is gone: lease expired, left, or restarted."""

    exit_code = ExitCode.PEER_LOST

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        host: str = "?",
        iteration: int | None = None,
        phase: int | None = None,
        heartbeat_age_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.rank, self.host = rank, host
        self.iteration, self.phase = iteration, phase
        self.heartbeat_age_s = heartbeat_age_s


class PhaseFailedError(CoordinatorError):
    """An action failed on some rank, or the master aborted the phase."""

    exit_code = ExitCode.PHASE_FAILED

    def __init__(
        self, message: str, *, rank: int | None, iteration: int, phase: int, cause: str,
        fault: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank, self.iteration, self.phase, self.cause = rank, iteration, phase, cause
        # The failed step's signature (fault_signature of the action's error), when
        # the rank that failed published it; None: computed from `cause`.
        self.fault = fault


# What differs between two occurrences of one fault, masked in its signature:
# quoted text (a prompt, a JSON body), hex ids and numbers (ranks, counts,
# ports, pids, task ids, line numbers).
_VARYING: Final = (re.compile(r"'[^'\n]*'|\"[^\"\n]*\""),
                   re.compile(r"\b(?:0x)?[0-9a-f]*\d[0-9a-f]*\b"))
MAX_FAULT_CHARS: Final = 400


def fault_signature(text: str) -> str:
    """What identifies a step's failure across attempts and ranks: the first line of
    the action's error with quoted text, numbers and hex ids masked."""
    text = text.strip()
    text = text.splitlines()[0] if text else ""
    for pattern in _VARYING:
        text = pattern.sub("#", text)
    return text[:MAX_FAULT_CHARS]


class RunCompleted(CoordinatorError):
    """The run completed while this daemon waited to be taken back into the group
    (on_failure "shrink"): nothing is left for it to do."""

    exit_code = ExitCode.OK


class FencedError(CoordinatorError):
    """This daemon is superseded and must stop writing."""

    exit_code = ExitCode.FENCED


class Interrupted(CoordinatorError):
    """SIGINT or SIGTERM arrived."""

    exit_code = ExitCode.INTERRUPTED

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum


class ActionError(CoordinatorError):
    """Raised by an action to fail its phase with a message for every rank."""

    exit_code = ExitCode.PHASE_FAILED


class Cancelled(CoordinatorError):
    """The running action was cancelled because the group is stopping."""
