"""Shared-filesystem I/O: publish by rename, read by open+read, counted.

The only operations another node can rely on are a file published by rename
and read back with open()+read() (NFS close-to-open consistency).  Everything
here is built from those; nothing uses stat(), listings or mtimes to decide.

Everything here also treats the run directory as untrusted: paths inside a
confined run directory are resolved without following symlinks
(coordinator/storage/beneath.py), reads refuse anything but a regular file and stop
at a size cap, writes and appends never go through a symlink, and
directories get mode 0755 whatever the umask.

Every system call goes through `STATS`, so benchmarks and tests can assert
how many metadata and data operations a poll costs.  Counting is a few dict
updates per call: cheap next to any real filesystem operation.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import secrets
import stat
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from coordinator.errors import UnsafeFileError, storage_error
from coordinator.routing import TMP_SUFFIX, routed
from coordinator.storage import beneath

FILE_MODE: Final = 0o644  # no group/world write: peers read, only the writer writes
DIR_MODE: Final = beneath.DIR_MODE
# Records are a few KB; run.json with a large config some tens of KB.  A file
# beyond this is not a record, whatever it claims to be.
MAX_RECORD_BYTES: Final = 4 << 20
# Rank manifests and shard plans list task ids: a million ids fit.
MAX_DOCUMENT_BYTES: Final = 256 << 20
_READ_CHUNK: Final = 1 << 20

# How long a read of a shared file retries a torn, unparsable or transiently
# failing read before it reports it, when the caller gives no deadline: the
# daemon sets it to coordination.read_retry_s at start-up (set_read_retry), so
# rollout/ and trainer/ reads in its process follow the same setting.
_read_retry_s = 5.0
# A daemon passes its setting to the processes it starts (torchrun's trainers).
READ_RETRY_ENV: Final = "COORDINATOR_READ_RETRY_S"


def set_read_retry(seconds: float) -> None:
    """This process's default retry deadline for reads of shared files."""
    global _read_retry_s
    if not 0 <= seconds <= 600:
        raise ValueError(f"read retry {seconds!r} s is outside 0..600: give e.g. 5")
    _read_retry_s = float(seconds)


def read_retry_from_env() -> None:
    """Take the starting daemon's setting (READ_RETRY_ENV), when there is one."""
    value = os.environ.get(READ_RETRY_ENV)
    if value:
        try:
            set_read_retry(float(value))
        except ValueError as exc:
            raise ValueError(f"{READ_RETRY_ENV}={value!r}: {exc}") from None


def read_retry(retry_s: float | None) -> float:
    """`retry_s`, or this process's default when it is None."""
    return _read_retry_s if retry_s is None else retry_s


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

    def dump_for_benchmark(self, rank: int) -> None:
        """Benchmarks set COORDINATOR_FS_STATS to a directory to get a daemon's counts."""
        target = os.environ.get("COORDINATOR_FS_STATS")
        if not target:
            return
        counts = {tag: dict(self.snapshot(tag))
                  for tag in ("poll", "heartbeat", "monitor", "other")}
        path = Path(target) / f"rank-{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rank": rank, "counts": counts}))

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
    try:
        beneath.make_dirs(path)
    except OSError as exc:
        raise storage_error(exc, path) or exc from None


def _fsync_dir_fd(fd: int) -> None:
    STATS.count("fsync_dir")
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some FUSE filesystems (sshfs, blobfuse) reject fsync on a directory:
        # the rename is already durable as far as they can promise.
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF):
            raise


def fsync_dir(path: Path) -> None:
    if routed(path) is not None:
        return  # a bucket: a PUT is durable when it returns
    STATS.count("open")
    fd = beneath.open_dir(path)
    try:
        _fsync_dir_fd(fd)
    finally:
        os.close(fd)


def _write_temp(dir_fd: int, name: str, data: bytes) -> str:
    """Write `data` to a new hidden temporary file in the directory; its name."""
    tmp = f".{name}.{secrets.token_hex(6)}{TMP_SUFFIX}"
    STATS.count("open")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 FILE_MODE, dir_fd=dir_fd)
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
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.close(fd)
    return tmp


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[tuple[int, str]]:
    """The parent directory (made if missing) for a write; storage errors named by path."""
    STATS.count("open")
    try:
        with beneath.parent_dir(path, create=True) as (dir_fd, name):
            yield dir_fd, name
    except OSError as exc:
        raise storage_error(exc, path) or exc from None


def publish_bytes(path: Path, data: bytes) -> None:
    """Atomically replace `path` with `data`: temp, fsync, rename, fsync dir."""
    if (route := routed(path)) is not None:
        route[0].publish(route[1], data)
        return
    with _writing(path) as (dir_fd, name):
        tmp = _write_temp(dir_fd, name, data)
        try:
            STATS.count("rename")
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        _fsync_dir_fd(dir_fd)


def create_exclusive(path: Path, data: bytes) -> bool:
    """Publish `path` only if it does not exist; True if we created it.

    link(2) is atomic and fails with EEXIST on NFSv3+, Lustre, GPFS and local
    filesystems, and unlike O_EXCL it never exposes a half-written file.
    """
    if (route := routed(path)) is not None:
        return route[0].create_exclusive(route[1], data)
    with _writing(path) as (dir_fd, name):
        tmp = _write_temp(dir_fd, name, data)
        try:
            STATS.count("link")
            os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            created = True
        except FileExistsError:
            created = False
        finally:
            STATS.count("unlink")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
        if created:
            _fsync_dir_fd(dir_fd)
        return created


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path, *, max_bytes: int | None = None, keep_local: bool = False) -> int:
    """A read descriptor of a regular file: never a symlink, FIFO, device or directory.

    O_NONBLOCK makes the open of a planted FIFO return at once instead of
    waiting for a writer; on a regular file it changes nothing.

    Beneath a bucket's root the object is fetched into the node-local root first:
    under a temporary name beside `path`, unlinked once open, so nothing stays on
    the node's disk once the descriptor is closed (a checkpoint's files, a
    training state's shards and a batch are read every iteration, and are
    model-sized); with `keep_local`, into `path` itself, for a reader that opens
    it by name after (trainer/local_view.py).
    """
    target = path
    if (route := routed(path)) is not None:
        if not keep_local:
            target = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TMP_SUFFIX}")
        route[0].download(route[1], target, max_bytes=max_bytes)
    STATS.count("open")
    try:
        fd = beneath.open_file(target, os.O_RDONLY | os.O_NONBLOCK)
    finally:
        if target != path:
            with contextlib.suppress(FileNotFoundError):
                beneath.remove_tree(target)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(path, f"is {_kind(st.st_mode)}, not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise UnsafeFileError(
                path, f"is {st.st_size} bytes, over the {max_bytes}-byte limit for this file")
    except BaseException:
        os.close(fd)
        raise
    return fd


# statx(2) flags: ask the filesystem itself for the size, not the client cache.
_AT_EMPTY_PATH: Final = 0x1000
_AT_STATX_FORCE_SYNC: Final = 0x2000
_STATX_SIZE: Final = 0x200


def revalidate(fd: int) -> None:
    """Make a network or FUSE client refetch an open file's attributes (its size).

    A client that caches attributes may cut a read of a file replaced by
    rename at the old file's cached size.  NFS revalidates at open (close-to-
    open), many FUSE clients do not; statx with AT_STATX_FORCE_SYNC makes
    both ask the server.  Used only when a read looked torn.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)
        libc.statx(ctypes.c_int(fd), b"", ctypes.c_int(_AT_EMPTY_PATH | _AT_STATX_FORCE_SYNC),
                   ctypes.c_uint(_STATX_SIZE), buf)
    except (OSError, AttributeError):  # no statx in this libc: the retry still helps
        pass


def read_bytes(path: Path, *, max_bytes: int = MAX_RECORD_BYTES, fresh: bool = False) -> bytes:
    """open()+read() of a whole regular file; FileNotFoundError when absent.

    At most `max_bytes` are read, whatever the file's size claims; `fresh`
    revalidates the cached size first (a retry after a torn read).
    """
    if (route := routed(path)) is not None:
        return route[0].read_bytes(route[1], max_bytes=max_bytes)
    fd = open_regular(path, max_bytes=max_bytes)
    try:
        if fresh:
            revalidate(fd)
        chunks = []
        total = 0
        while True:
            STATS.count("read")
            chunk = os.read(fd, min(_READ_CHUNK, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise UnsafeFileError(path, f"holds more than the {max_bytes}-byte limit")
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_append(path: Path) -> int:
    """A descriptor for appending to a log: made if missing, never through a symlink."""
    try:
        beneath.make_dirs(path.parent)
        fd = beneath.open_file(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK,
                               FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO nobody reads: O_NONBLOCK refused to wait
            raise UnsafeFileError(path, "is a FIFO, not a regular file") from None
        raise storage_error(exc, path) or exc from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(path, f"is {_kind(st.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove(path: Path) -> bool:
    """unlink (a symlink itself, never its target); False if it was already gone."""
    if (route := routed(path)) is not None:
        with contextlib.suppress(FileNotFoundError):
            beneath.remove_tree(path)  # a copy fetched into the local root
        return route[0].remove(route[1])
    STATS.count("unlink")
    try:
        with beneath.parent_dir(path, create=False) as (dir_fd, name):
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def remove_tree(path: Path) -> bool:
    """rm -r beneath the run directory, never following a symlink."""
    if (route := routed(path)) is not None:
        with contextlib.suppress(FileNotFoundError):
            beneath.remove_tree(path)
        return route[0].remove_prefix(route[1])
    STATS.count("rmdir")
    return beneath.remove_tree(path)


def rename(src: Path, dst: Path) -> None:
    """rename(2) beneath the run directory.  Beneath a bucket's root: a writer's local
    staging file published under its name is an upload (then the file goes); one object
    to another is a copy and a delete (not atomic: never how anything is published)."""
    source, target = routed(src), routed(dst)
    if target is not None:
        if source is None:
            target[0].upload(target[1], src)
            beneath.remove_tree(src)
            return
        if source[0] is not target[0]:
            raise ValueError(f"rename of {src} to {dst} leaves its bucket")
        target[0].rename(source[1], target[1])
        return
    if source is not None:
        raise ValueError(f"rename of {src} to {dst} leaves its bucket")
    STATS.count("rename")
    with beneath.parent_dir(src, create=False) as (src_fd, src_name), \
            beneath.parent_dir(dst, create=True) as (dst_fd, dst_name):
        os.rename(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
