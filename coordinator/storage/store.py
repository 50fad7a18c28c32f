"""Storage behind a small interface: publish a record, read a record.

`FsStore` is the shared-filesystem backend every daemon uses; `MemoryStore`
implements the same interface in memory for unit tests of the record layer.
`read_record` and `read_document` add the rules of docs/PROTOCOL.md on top:
retry torn, stale or unreadable files within a deadline, then report the
file as malformed with its path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import tenacity

from coordinator.errors import UnsafeFileError
from coordinator.records.records import Record
from coordinator.storage import fsio, trees

log = logging.getLogger(__name__)
R = TypeVar("R", bound=Record)
T = TypeVar("T")


class Store(Protocol):
    """Whole-file records under relative keys; one writer per key."""

    def publish(self, key: str, data: bytes) -> None: ...

    def read(self, key: str, *, fresh: bool = False) -> bytes | None:
        """The file's bytes, or None when it does not exist.

        `fresh`: a retry after a torn read; ask the server, not a client cache.
        """
        ...

    def create_exclusive(self, key: str, data: bytes) -> bool: ...

    def remove(self, key: str) -> bool: ...

    def rename(self, src: str, dst: str) -> None: ...

    def listdir(self, key: str) -> list[str]:
        """Names in a directory: a hint for humans and recovery, never for waits."""
        ...


class FsStore:
    """The run directory on a (possibly network) filesystem."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, key: str) -> Path:
        return self.root / key

    def publish(self, key: str, data: bytes) -> None:
        fsio.publish_bytes(self.path(key), data)

    def read(self, key: str, *, fresh: bool = False) -> bytes | None:
        try:
            return fsio.read_bytes(self.path(key), fresh=fresh)
        except FileNotFoundError:
            return None

    def create_exclusive(self, key: str, data: bytes) -> bool:
        return fsio.create_exclusive(self.path(key), data)

    def remove(self, key: str) -> bool:
        return fsio.remove(self.path(key))

    def rename(self, src: str, dst: str) -> None:
        fsio.ensure_dir(self.path(dst).parent)
        fsio.rename(self.path(src), self.path(dst))

    def listdir(self, key: str) -> list[str]:
        """Names in a directory reached without a symlink (UnsafeFileError otherwise)."""
        return trees.listdir(self.path(key))


class MemoryStore:
    """In-memory `Store` for unit tests; counts reads per key."""

    def __init__(self) -> None:
        self._files: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.reads: list[str] = []

    def publish(self, key: str, data: bytes) -> None:
        with self._lock:
            self._files[key] = bytes(data)

    def read(self, key: str, *, fresh: bool = False) -> bytes | None:
        with self._lock:
            self.reads.append(key)
            return self._files.get(key)

    def create_exclusive(self, key: str, data: bytes) -> bool:
        with self._lock:
            if key in self._files:
                return False
            self._files[key] = bytes(data)
            return True

    def remove(self, key: str) -> bool:
        with self._lock:
            return self._files.pop(key, None) is not None

    def rename(self, src: str, dst: str) -> None:
        with self._lock:
            if src not in self._files:
                raise FileNotFoundError(src)  # as os.rename and a bucket's copy say it
            self._files[dst] = self._files.pop(src)

    def listdir(self, key: str) -> list[str]:
        prefix = key.rstrip("/") + "/"
        with self._lock:
            names = {k[len(prefix):].split("/")[0] for k in self._files if k.startswith(prefix)}
        return sorted(names)


def _retryable(exc: BaseException) -> bool:
    # A FIFO, device, symlink or directory at a record's name is no torn or stale
    # read: a writer only ever renames a regular file there, so asking again
    # cannot change it, and the error names it at once.
    if isinstance(exc, UnsafeFileError):
        return False
    return isinstance(exc, ValueError) or fsio.is_transient(exc)


def read_retrying(
    read: Callable[[bool], bytes | None],
    parse: Callable[[bytes, Path], T],
    path: Path,
    *,
    retry_s: float | None,
    sleep: Callable[[float], None] = time.sleep,
) -> T | None:
    """Read and strictly parse one file; None when it does not exist.

    `read(fresh)` returns the bytes (None when absent); `parse` raises a
    ValueError (MalformedRecordError and the other schema errors are ones)
    when the bytes are not a valid file of its kind.  A torn read (a client
    with a stale cached size), ESTALE after a rename, EIO or an unparsable
    file is retried with backoff for `retry_s` (None: fsio.read_retry), each
    retry asking the server afresh; then the last error is raised, naming the file.
    """
    retry_s = fsio.read_retry(retry_s)

    def attempt(fresh: bool) -> T | None:
        data = read(fresh)
        if data is None:
            return None
        return parse(data, path)

    try:
        return attempt(False)  # the common case: one open+read, no retry machinery
    except Exception as exc:
        if not _retryable(exc) or retry_s <= 0:
            raise
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(_retryable),
        stop=tenacity.stop_after_delay(retry_s),
        wait=tenacity.wait_exponential(multiplier=0.005, max=0.5),
        sleep=sleep,
        reraise=True,
        before_sleep=lambda state: log.debug(
            "retrying read of %s: %s", path, state.outcome.exception() if state.outcome else "?"
        ),
    )
    return retrying(attempt, True)


def read_record(
    store: Store,
    key: str,
    cls: type[R],
    *,
    retry_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> R | None:
    """One record of the protocol, by key; see `read_retrying`."""
    path = Path(getattr(store, "root", Path("<memory>"))) / key
    return read_retrying(lambda fresh: store.read(key, fresh=fresh), cls.from_bytes, path,
                         retry_s=retry_s, sleep=sleep)


def read_document(
    path: Path,
    parse: Callable[[bytes, Path], T],
    *,
    retry_s: float | None = None,
    max_bytes: int = fsio.MAX_DOCUMENT_BYTES,
    sleep: Callable[[float], None] = time.sleep,
) -> T | None:
    """A JSON file of rollout/ or trainer/ in the run directory (rank manifest, shard
    plan, train job, metrics, checkpoint manifest): the records' reader and rules."""

    def read(fresh: bool) -> bytes | None:
        try:
            return fsio.read_bytes(path, max_bytes=max_bytes, fresh=fresh)
        except FileNotFoundError:
            return None

    return read_retrying(read, parse, path, retry_s=retry_s, sleep=sleep)


def publish_record(store: Store, key: str, record: Record) -> None:
    store.publish(key, record.to_bytes())
