"""Directory-level operations on the run directory, on a filesystem or in a bucket.

What fsio does for one record, these do for a directory of files: whether it
exists, its listing, every file beneath it, publishing a staged directory (a
checkpoint) and sending files a library wrote as plain local files.  On a
filesystem they are the usual calls; beneath a bucket's root (coordinator/
routing.py) they are LIST, HEAD and PUT requests, and `publish_tree` uploads a
checkpoint's files with its manifest last, since a bucket has no rename.
Listings are hints, as everywhere in the protocol: no wait depends on one.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from coordinator.errors import UnsafeFileError
from coordinator.routing import routed
from coordinator.storage import beneath, fsio


def exists(path: Path) -> bool:
    """Whether a file exists (a hint, as on any shared filesystem): beneath a bucket's
    root, whether its object does (a HEAD request)."""
    if (route := routed(path)) is not None:
        return route[0].exists(route[1])
    return path.exists()


def listdir(path: Path) -> list[str]:
    """Sorted names in a directory reached without a symlink ([] when it does not
    exist): a hint for recovery and humans, never for waits.  Beneath a bucket's
    root, the names a LIST shows directly beneath the key."""
    if (route := routed(path)) is not None:
        return route[0].listdir(route[1])
    fsio.STATS.count("listdir")
    try:
        fd = beneath.open_dir(path)
    except FileNotFoundError:
        return []
    try:
        return sorted(os.listdir(fd))
    finally:
        os.close(fd)


def is_dir(path: Path) -> bool:
    """Whether `path` is a directory; beneath a bucket's root, whether any object's name
    starts with it (a bucket has no directories)."""
    if (route := routed(path)) is not None:
        return bool(route[0].listdir(route[1]))
    return path.is_dir()


def list_files(root: Path) -> list[str]:
    """Every regular file beneath `root`, as sorted relative names ('a/b.json'); a
    symlink is refused (UnsafeFileError), as checkpoints may not hold one."""
    if (route := routed(root)) is not None:
        return route[0].list_files(route[1])
    out = []
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            raise UnsafeFileError(path, "is a symlink: a published tree may not hold one")
        if path.is_file():
            out.append(path.relative_to(root).as_posix())
    return out


def publish_tree(tmp: Path, final: Path, *, last: str) -> None:
    """Publish a fully written, fsynced directory `tmp` (a checkpoint) as `final`.

    On a filesystem, one rename of the directory (onto nothing or an empty one).
    Beneath a bucket's root, where no rename exists: every file of `tmp` becomes
    an object under `final`, the file named `last` (its manifest) after all the
    others, so a reader that finds `last` finds the rest; then `tmp` goes.
    FileExistsError when `final` already holds something.
    """
    if (route := routed(final)) is not None:
        backend, key = route
        if backend.listdir(key):
            try:
                backend.read_bytes(f"{key}/{last}", max_bytes=fsio.MAX_DOCUMENT_BYTES)
            except FileNotFoundError:
                # Objects without their `last`: an interrupted publish of this tree (one
                # writer per tree), never seen by a reader: cleared, then published.
                backend.remove_prefix(key)
            else:
                raise FileExistsError(errno.EEXIST, "already published", str(final))
        names = [n for n in list_files(tmp) if n != last]
        for name in [*names, last]:
            backend.upload(f"{key}/{name}", tmp / name)
        beneath.remove_tree(tmp)
        return
    fsio.rename(tmp, final)


# What this process last sent of each local file (send_local_files): its size and
# mtime, so an unchanged log is not uploaded again at every iteration's end.
_sent: dict[Path, tuple[int, int]] = {}


def send_local_files(directory: Path, *, replace: bool) -> int:
    """Beneath a bucket's root: send the files written as plain local files there (a
    library's: TensorBoard's event files; the engines' and trainers' logs), each as an
    object of its name; with `replace`, again when it changed since this process sent
    it (a log that grew), else only the ones the bucket does not hold.  How many were
    sent.  On a filesystem they are where they belong already: 0."""
    if (route := routed(directory)) is None or not directory.is_dir():
        return 0
    backend, key = route
    held = set() if replace else set(backend.list_files(key))
    sent = 0
    for path in sorted(directory.rglob("*")):
        name = path.relative_to(directory).as_posix()
        if not path.is_file() or path.is_symlink() or name in held:
            continue
        st = path.stat()
        if _sent.get(path) == (st.st_size, st.st_mtime_ns):
            continue
        backend.upload(f"{key}/{name}", path)
        _sent[path] = (st.st_size, st.st_mtime_ns)
        sent += 1
    return sent
