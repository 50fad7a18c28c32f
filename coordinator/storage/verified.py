"""Binary files of the run directory, read only as their manifest describes them.

Trajectory chunks, training batches and checkpoint shards are listed in a
manifest with their size and SHA-256.  `read_verified` opens such a file the
safe way (coordinator/storage/fsio.py: no symlink, regular files only), checks its
size, hashes it and hands it to the caller, and tells three outcomes apart:

    as listed          -> a `Verified` file: a descriptor whose mapping was
                          hashed (zero-copy loading), or the bytes themselves
                          where the filesystem cannot map files (FUSE
                          direct_io answers ENODEV)
    different content  -> IntegrityError (corruption: a caller may redo the work)
    I/O error          -> OSError naming the path (never reported as corruption)

A short or stale read (a client cache holding the old file's size) is
retried within the deadline, each time asking the server for the size again,
before the file counts as different.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import io
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final, TypeVar

import tenacity

from coordinator.errors import IntegrityError
from coordinator.storage import fsio

log = logging.getLogger(__name__)
T = TypeVar("T")
_BLOCK: Final = 4 << 20
_AHEAD: Final = 4  # blocks read ahead of the hash and the write (16 MiB per copy)
# A copy whose source gives no block for this long fails, naming it, rather than wait
# forever on a shared filesystem whose server is gone (a hard NFS mount's read blocks
# until it is back): the lock holders behind the copy would wait in silence.
STALL_S: Final = 300.0
_READER_EXIT_S: Final = 30.0  # a reader told to stop ends within its current read
_THREADS: Final = 8  # files copied at once, at most
# mmap refuses these on filesystems that cannot map (FUSE direct_io, some
# network mounts): the file is then read into memory instead.
_NO_MAP: Final = frozenset({errno.ENODEV, errno.EINVAL, errno.EACCES, errno.ENOTSUP})


@dataclass(eq=False)
class Verified:
    """A file whose size and SHA-256 matched its manifest; close() when done."""

    path: Path
    fd: int | None = None  # mapped and hashed: load from source() with mmap
    data: bytes | None = None  # read and hashed: load from source()

    @property
    def mapped(self) -> bool:
        return self.fd is not None

    def source(self) -> str | IO[bytes]:
        """What torch.load reads: the hashed inode itself, never the path again."""
        if self.fd is not None:
            return f"/proc/self/fd/{self.fd}"
        assert self.data is not None
        return io.BytesIO(self.data)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.data = None

    def __enter__(self) -> Verified:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sha256_mapped(fd: int) -> str | None:
    """SHA-256 through a read-only mapping, or None when the filesystem cannot map."""
    try:
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
            return hashlib.sha256(mapped).hexdigest()  # releases the GIL while hashing
    except OSError as exc:
        if exc.errno in _NO_MAP:
            return None
        raise
    except ValueError:  # an empty file cannot be mapped
        return None


def _read_all(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = os.read(fd, min(_BLOCK, limit + 1 - total))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            return b"".join(chunks)


def _attempt(path: Path, size: int, sha256: str, allow_map: bool, fresh: bool,
             keep_local: bool = False) -> Verified:
    fd = fsio.open_regular(path, keep_local=keep_local)
    keep = False
    try:
        if fresh:
            fsio.revalidate(fd)
        actual_size = os.fstat(fd).st_size
        if actual_size != size:
            raise IntegrityError(path, f"is {actual_size} bytes, its manifest says {size}: the "
                                 "file is truncated or altered")
        if allow_map and size > 0:
            digest = _sha256_mapped(fd)
            if digest is not None:
                if digest != sha256:
                    raise _mismatch(path, digest, sha256)
                keep = True
                return Verified(path=path, fd=fd)
        data = _read_all(fd, size)
        if len(data) != size:
            raise IntegrityError(path, f"read {len(data)} bytes, its manifest says {size}")
        digest = hashlib.sha256(data).hexdigest()
        if digest != sha256:
            raise _mismatch(path, digest, sha256)
        return Verified(path=path, data=data)
    finally:
        if not keep:
            os.close(fd)


def _mismatch(path: Path, actual: str, expected: str) -> IntegrityError:
    return IntegrityError(path, f"SHA-256 {actual[:16]}... differs from its manifest's "
                          f"{expected[:16]}...: the file is truncated or altered")


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, IntegrityError) or fsio.is_transient(exc)


def read_verified(
    path: Path, *, size: int, sha256: str, retry_s: float | None = None, allow_map: bool = True,
    sleep: Callable[[float], None] = time.sleep, keep_local: bool = False,
) -> Verified:
    """The file at `path` if it is exactly `size` bytes with this SHA-256 (beneath a
    bucket's root, `keep_local` leaves the fetched file at `path`: fsio.open_regular).

    IntegrityError when it still differs after `retry_s` (None: fsio.read_retry);
    OSError (its path
    named) for an I/O error that outlasted the retries; FileNotFoundError when
    it is gone; UnsafeFileError when it is not a regular file.
    """
    retry_s = fsio.read_retry(retry_s)
    try:
        return _attempt(path, size, sha256, allow_map, fresh=False, keep_local=keep_local)
    except Exception as exc:
        if not _retryable(exc) or retry_s <= 0:
            raise _named(exc, path) from None
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(_retryable),
        stop=tenacity.stop_after_delay(retry_s),
        wait=tenacity.wait_exponential(multiplier=0.01, max=0.5),
        sleep=sleep, reraise=True,
        before_sleep=lambda state: log.debug(
            "re-reading %s: %s", path, state.outcome.exception() if state.outcome else "?"),
    )
    try:
        return retrying(_attempt, path, size, sha256, allow_map, True, keep_local)
    except Exception as exc:
        raise _named(exc, path) from None


def _named(exc: BaseException, path: Path) -> BaseException:
    if isinstance(exc, OSError) and not exc.filename:
        return OSError(exc.errno, exc.strerror, str(path))
    return exc


def file_digest(path: Path) -> tuple[int, str]:
    """(size, SHA-256) of a regular file, read the safe way, in blocks."""
    digest = hashlib.sha256()
    size = 0
    fd = fsio.open_regular(path)
    try:
        while block := os.read(fd, _BLOCK):
            digest.update(block)
            size += len(block)
    finally:
        os.close(fd)
    return size, digest.hexdigest()


def copy_hashed(src: Path, dst: Path, *, limit: int | None = None,
                fsync: bool = True) -> tuple[int, str]:
    """Copy `src` to a new file `dst` (fsynced, unless `fsync` is False: a node-local
    copy sealed for this boot, coordinator/storage/local_seal.py) in one pass, hashing
    what was read: (bytes copied, SHA-256).  Stops once more than `limit` bytes were read.

    A reader thread keeps up to _AHEAD blocks in flight while this one hashes and
    writes them, so the copy runs at the slower of the source's read and the
    hash+write, not their sum (os.read, hashlib and write release the GIL).
    """
    blocks: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=_AHEAD)
    stop = threading.Event()
    fd = fsio.open_regular(src)

    def read() -> None:
        total = 0
        try:
            while not stop.is_set():
                block = os.read(fd, _BLOCK)
                blocks.put(block or None)
                total += len(block)
                if not block or (limit is not None and total > limit):
                    return
        except BaseException as exc:  # handed to the consumer, which raises it
            blocks.put(exc)

    reader = threading.Thread(target=read, name=f"read {src.name}", daemon=True)
    digest, copied = hashlib.sha256(), 0
    reader.start()
    try:
        with _new_file(dst) as out:
            while (block := _next_block(blocks, src, copied)) is not None:
                if isinstance(block, BaseException):
                    raise block
                digest.update(block)
                out.write(block)
                copied += len(block)
                if limit is not None and copied > limit:
                    break
            out.flush()
            if fsync:
                os.fsync(out.fileno())
    finally:
        stop.set()
        with contextlib.suppress(queue.Empty):
            while True:  # unblock a reader waiting to put
                blocks.get_nowait()
        reader.join(timeout=_READER_EXIT_S)
        if reader.is_alive():  # still in a read that never returns: its descriptor stays
            log.error("%s: the read of the shared filesystem never returned; its thread "
                      "and descriptor are left behind", src)
        else:
            os.close(fd)
    return copied, digest.hexdigest()


def _next_block(blocks: queue.Queue[bytes | BaseException | None], src: Path,
                copied: int) -> bytes | BaseException | None:
    try:
        return blocks.get(timeout=STALL_S)
    except queue.Empty:
        raise OSError(errno.ETIMEDOUT, f"no data from the shared filesystem for {STALL_S:g} s "
                      f"after {copied} bytes: is its server gone?", str(src)) from None


def copy_verified(src: Path, dst: Path, *, size: int, sha256: str,
                  fsync: bool = True) -> None:
    """Copy `src` to a new file `dst`, hashing what was read; IntegrityError if it differs.

    The copy is checked against the manifest's size and hash as it is made, so
    a source that changes mid-copy is caught, never cached; the source is read
    once (no separate verification pass).
    """
    copied, digest = copy_hashed(src, dst, limit=size, fsync=fsync)
    if copied != size or digest != sha256:
        raise IntegrityError(
            src, f"copied {copied} bytes with SHA-256 {digest[:16]}..., its manifest "
            f"says {size} bytes, {sha256[:16]}...: the file is altered, or it changed while copied")


def in_parallel(work: Mapping[str, Callable[[], T]], *,
                threads: int | None = None) -> dict[str, T]:
    """Every call of `work` (name -> call), on up to `threads` threads (default: one
    per core, at most _THREADS): each file of a checkpoint copied and hashed at once,
    using the cores and the filesystem's parallel streams.  The results by name; the
    first failure (in name order) is raised once every call has ended."""
    if len(work) <= 1:
        return {name: call() for name, call in work.items()}
    workers = min(len(work), threads or min(os.cpu_count() or 1, _THREADS))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="copy") as pool:
        futures = {name: pool.submit(call) for name, call in sorted(work.items())}
        concurrent.futures.wait(futures.values())
    return {name: future.result() for name, future in futures.items()}


@contextlib.contextmanager
def _new_file(path: Path) -> Iterator[IO[bytes]]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 fsio.FILE_MODE)
    with os.fdopen(fd, "wb") as handle:
        yield handle
