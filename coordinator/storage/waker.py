"""Wake a waiter early when a file it polls is renamed into place on this host.

Only a hint: inotify and its kin see changes made through this kernel, so on
NFS they stay silent and waiters fall back to their poll interval.  Records
are published by rename, so a rename onto a watched name is the only event
that matters; opens, writes and reads must not wake anyone (every waiter
reads the watched files, and waking on reads turns polling into a storm).

Two backends behind one interface (`event`, `watch`, `drain`, `close`):

- Linux: inotify through libc with the kernel filtering to IN_MOVED_TO on the
  parent directories of the watched files only.  One rename costs one 32-byte
  event and a set lookup in one thread.  watchdog, on the same workload,
  receives create/modify/close/moved-from/moved-to for every temporary file,
  pairs moves through a linearly searched delay queue and hops two threads:
  at 64 ranks on 2 cores its thread was the master's largest CPU consumer
  (docs/BENCHMARKS.md).
- Elsewhere (macOS, BSD): watchdog's native observer on the same directories.

When neither can start (inotify limits, exotic filesystem), waiters poll.

`complete` says whether the events can replace fast polling: on a local
filesystem (one kernel sees every write) with every watched directory in
place, a rename always produces an event here, so the poll is only a safety
net and can run at its ceiling.  On NFS, Lustre, GPFS or FUSE the writers sit
on other hosts, no event ever comes, and waiters poll fast.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import errno
import logging
import os
import select
import struct
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Final, Protocol

log = logging.getLogger(__name__)

IN_MOVED_TO: Final = 0x00000080
IN_Q_OVERFLOW: Final = 0x00004000
IN_IGNORED: Final = 0x00008000
IN_ONLYDIR: Final = 0x01000000
IN_NONBLOCK: Final = os.O_NONBLOCK
IN_CLOEXEC: Final = os.O_CLOEXEC
_EVENT: Final = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name
# Filesystems whose every writer is this kernel, so inotify sees every rename.
class _Backend(Protocol):
    def add_dir(self, directory: str) -> None: ...
    def close(self) -> None: ...


class Backend(str, enum.Enum):
    INOTIFY = "inotify"
    WATCHDOG = "watchdog"
    NONE = "none"  # neither could start: waiters poll


class Waker:
    """Sets `event` when one of the files of interest is renamed into place."""

    @classmethod
    def for_run_dir(cls, run_dir: Path) -> Waker:
        """The daemon's waker: events are trusted as local only on a local filesystem."""
        from coordinator import routing
        from coordinator.storage.mounts import LOCAL_FILESYSTEMS, filesystem_type

        if routing.routed(run_dir) is not None:
            log.info("file-change wake-ups: none in a bucket (%s): waits poll with capped "
                     "backoff", routing.display(run_dir))
            return cls(backend=Backend.NONE)
        fs_type = filesystem_type(run_dir)
        waker = cls(local=fs_type in LOCAL_FILESYSTEMS)
        log.info("file-change wake-ups: %s on %s (%s): %s", waker.backend.value, run_dir,
                 fs_type or "unknown filesystem",
                 "polls are a safety net at the ceiling" if waker.local
                 else "writers on other hosts are seen by polling")
        return waker

    def __init__(self, *, backend: Backend | None = None, local: bool = False) -> None:
        """`backend`: None picks inotify on Linux, watchdog elsewhere."""
        # `local`: the watched files live on a filesystem in LOCAL_FILESYSTEMS.
        self.event = threading.Event()
        self.local = local
        self._interest: frozenset[str] = frozenset()
        self._changed: set[str] = set()
        self._lock = threading.Lock()
        self._dirs: set[str] = set()
        self._complete = True  # every directory of the interest set is watched
        self._backend: _Backend | None = None
        if backend is None:
            backend = Backend.INOTIFY if sys.platform.startswith("linux") else Backend.WATCHDOG
        try:
            if backend is not Backend.NONE:
                self._backend = _Inotify(self._renamed) if backend is Backend.INOTIFY else \
                    _Watchdog(self._renamed)
        except Exception as exc:
            log.debug("file-change wake-ups unavailable (%s): %s", backend.value, exc)
        self.backend = backend if self._backend is not None else Backend.NONE

    def watch(self, paths: Iterable[str | Path]) -> None:
        """Wake on renames onto exactly these files (replaces the previous set)."""
        interest = frozenset(str(p) for p in paths)
        if interest == self._interest and self._complete:
            return  # the master re-states its set on every poll: keep that cheap
        self._interest = interest
        if self._backend is None:
            return
        self._complete = True
        for directory in {os.path.dirname(p) for p in interest} - self._dirs:
            try:
                self._backend.add_dir(directory)
                self._dirs.add(directory)
            except OSError as exc:  # missing directory, watch limit: polling covers it
                self._complete = False
                log.debug("cannot watch %s: %s", directory, exc)

    @property
    def complete(self) -> bool:
        """Every rename onto a watched file will wake us: timed polls are only a safety net."""
        return self.local and self.backend is Backend.INOTIFY and self._complete

    def drain(self) -> set[str]:
        """The watched files renamed into place since the last drain."""
        with self._lock:
            changed, self._changed = self._changed, set()
        return changed

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None

    def _renamed(self, paths: Iterable[str] | None) -> None:
        """Backend callback; None means events were lost: wake and let the poll sweep."""
        interest = self._interest
        hits = set(interest) if paths is None else {p for p in paths if p in interest}
        if hits:
            with self._lock:
                self._changed |= hits
            self.event.set()


class _Inotify:
    """inotify(7) with IN_MOVED_TO on whole directories, read by one thread."""

    def __init__(self, on_renamed) -> None:  # type: ignore[no-untyped-def]
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._add = libc.inotify_add_watch
        self._add.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self._fd = fd
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._dirs: dict[int, str] = {}
        self._on_renamed = on_renamed
        self._thread = threading.Thread(target=self._run, name="inotify", daemon=True)
        self._thread.start()

    def add_dir(self, directory: str) -> None:
        wd = self._add(self._fd, os.fsencode(directory), IN_MOVED_TO | IN_ONLYDIR)
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_add_watch: {os.strerror(err)}", directory)
        self._dirs[wd] = directory

    def close(self) -> None:
        try:
            os.write(self._stop_w, b"x")
        except OSError:
            return  # already closed
        self._thread.join(timeout=5.0)
        for fd in (self._fd, self._stop_r, self._stop_w):
            os.close(fd)

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._stop_r in ready:
                return
            try:
                data = os.read(self._fd, 64 * 1024)
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EINTR):
                    continue
                log.debug("inotify read failed, wake-ups stop: %s", exc)
                return
            self._on_renamed(self._parse(data))

    def _parse(self, data: bytes) -> list[str] | None:
        paths: list[str] = []
        overflow = False
        offset = 0
        while offset + _EVENT.size <= len(data):
            wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
            name = data[offset + _EVENT.size:offset + _EVENT.size + length].rstrip(b"\0")
            offset += _EVENT.size + length
            if mask & IN_Q_OVERFLOW:
                overflow = True
            elif mask & IN_IGNORED:
                self._dirs.pop(wd, None)  # the directory went away
            elif wd in self._dirs and name:
                paths.append(f"{self._dirs[wd]}/{os.fsdecode(name)}")
        return None if overflow else paths


class _Watchdog:
    """watchdog's native observer, one non-recursive watch per directory."""

    def __init__(self, on_renamed) -> None:  # type: ignore[no-untyped-def]
        from watchdog.events import FileMovedEvent, FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer

        class _Handler(FileSystemEventHandler):
            def on_moved(self, event) -> None:  # type: ignore[no-untyped-def]
                on_renamed([os.fsdecode(event.dest_path)])

        self._handler = _Handler()
        self._moved: list[type[FileSystemEvent]] = [FileMovedEvent]
        self._observer = Observer()
        self._observer.daemon = True
        self._observer.start()

    def add_dir(self, directory: str) -> None:
        if not os.path.isdir(directory):
            raise FileNotFoundError(errno.ENOENT, "no such directory", directory)
        self._observer.schedule(self._handler, directory, recursive=False,
                                event_filter=self._moved)

    def close(self) -> None:
        self._observer.stop()
