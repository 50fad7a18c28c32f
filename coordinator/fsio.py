"""Shared-filesystem I/O: publish by rename, read by open+read, counted.

The only operations another node can rely on are a file published by rename
and read back with open()+read() (NFS close-to-open consistency).  Everything
here is built from those; nothing uses stat(), listings or mtimes to decide.

Every system call goes through `STATS`, so benchmarks and tests can assert
how many metadata and data operations a poll costs.  Counting is a few dict
updates per call: cheap next to any real filesystem operation.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Final

FILE_MODE: Final = 0o644  # no group/world write: peers read, only the writer writes
DIR_MODE: Final = 0o755
TMP_SUFFIX: Final = ".tmp"

# Errors a network filesystem returns transiently: the file was replaced under
# an open handle (ESTALE), the server hiccuped (EIO), or a FUSE/NFS client
# timed out (ETIMEDOUT).  Callers retry these within their deadline.
TRANSIENT_ERRNOS: Final = frozenset({errno.ESTALE, errno.EIO, errno.ETIMEDOUT, errno.EAGAIN})

METADATA_OPS: Final = frozenset(
    {"open", "stat", "rename", "link", "unlink", "mkdir", "listdir", "rmdir", "fsync_dir"}
)
DATA_OPS: Final = frozenset({"read", "write", "fsync"})


class FsStats:
    """Counts filesystem operations per thread tag ("poll", "heartbeat", ...)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()
        self._local = threading.local()

    def count(self, op: str) -> None:
        tag = getattr(self._local, "tag", "other")
        with self._lock:
            self._counts[(tag, op)] += 1

    @contextlib.contextmanager
    def tagged(self, tag: str) -> Iterator[None]:
        previous = getattr(self._local, "tag", "other")
        self._local.tag = tag
        try:
            yield
        finally:
            self._local.tag = previous

    def snapshot(self, tag: str | None = None) -> Counter[str]:
        with self._lock:
            out: Counter[str] = Counter()
            for (t, op), n in self._counts.items():
                if tag is None or t == tag:
                    out[op] += n
            return out

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()

    @staticmethod
    def split(counts: Counter[str]) -> tuple[int, int]:
        """(metadata, data) totals of a snapshot."""
        meta = sum(n for op, n in counts.items() if op in METADATA_OPS)
        data = sum(n for op, n in counts.items() if op in DATA_OPS)
        return meta, data


STATS: Final = FsStats()


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS


def temp_name(path: Path) -> Path:
    """A unique temporary name beside `path`, hidden and marked for recovery."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}{TMP_SUFFIX}")


def ensure_dir(path: Path) -> None:
    """mkdir -p with the project's mode; tolerates a concurrent creator."""
    STATS.count("mkdir")
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)


def fsync_dir(path: Path) -> None:
    STATS.count("open")
    STATS.count("fsync_dir")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some FUSE filesystems (sshfs, blobfuse) reject fsync on a directory:
        # the rename is already durable as far as they can promise.
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _open_temp(path: Path) -> tuple[Path, int]:
    tmp = temp_name(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    STATS.count("open")
    try:
        return tmp, os.open(tmp, flags, FILE_MODE)
    except FileNotFoundError:
        # First file in a new directory: create it, then retry.  Trying the
        # open first saves a stat() on every publish into an existing one.
        ensure_dir(path.parent)
        STATS.count("open")
        return tmp, os.open(tmp, flags, FILE_MODE)


def _write_temp(path: Path, data: bytes) -> Path:
    tmp, fd = _open_temp(path)
    try:
        view = memoryview(data)
        while view:
            STATS.count("write")
            written = os.write(fd, view)
            view = view[written:]
        STATS.count("fsync")
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):  # best effort: recover removes leftovers
            os.unlink(tmp)
        raise
    os.close(fd)
    return tmp


def publish_bytes(path: Path, data: bytes) -> None:
    """Atomically replace `path` with `data`: temp, fsync, rename, fsync dir."""
    tmp = _write_temp(path, data)
    try:
        STATS.count("rename")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def create_exclusive(path: Path, data: bytes) -> bool:
    """Publish `path` only if it does not exist; True if we created it.

    link(2) is atomic and fails with EEXIST on NFSv3+, Lustre, GPFS and local
    filesystems, and unlike O_EXCL it never exposes a half-written file.
    """
    tmp = _write_temp(path, data)
    try:
        STATS.count("link")
        os.link(tmp, path)
        created = True
    except FileExistsError:
        created = False
    finally:
        STATS.count("unlink")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    if created:
        fsync_dir(path.parent)
    return created


def read_bytes(path: Path) -> bytes:
    """open()+read() of a whole file; FileNotFoundError when absent."""
    STATS.count("open")
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while True:
            STATS.count("read")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def remove(path: Path) -> bool:
    """unlink; False if it was already gone."""
    STATS.count("unlink")
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def rename(src: Path, dst: Path) -> None:
    STATS.count("rename")
    os.replace(src, dst)
