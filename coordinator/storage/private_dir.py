"""Node-local directories private to this user: the node cache and a bucket's local root.

    <anchor>/                       trusted: TMPDIR as the job gave it, or
                                    checkpoint.local_cache (the user's own path)
        coordinator-<uid>/          \\
            <run id>/                |  made here: each one a directory of this
        coordinator-bucket-<uid>/    |  user's, mode 0700, never a symlink; one
            <hash of the URL>/      /   found otherwise is refused (PrivateDirError)

Why: TMPDIR is often a /tmp every local user shares, where anyone can create a
name first, and these names are no secret (a uid; a URL's hash, the URL being
on `ps`).  A directory of another user's, one others may write, or a symlink to
a directory of ours, would let that user read what a run fetched, swap a
checkpoint file between its hash check and its load, or have a daemon's exit
empty a directory of ours.  So every component is opened relative to its
parent's descriptor with O_NOFOLLOW, made 0700 when missing, and accepted only
when `defect` finds nothing wrong.  Once the first component is ours and 0700
nobody else can create anything beneath it, and a sticky /tmp keeps others
from renaming it away.  `remove` empties one through descriptors and never
follows a symlink.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from coordinator.errors import UsageError
from coordinator.storage import beneath

MODE: Final = 0o700
_OPEN: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A component can vanish between two steps of a walk (a daemon leaving removes an
# empty base directory while another makes its run directory in it): walk again.
_ATTEMPTS: Final = 5


class Defect(str, enum.Enum):
    """What makes a name found where a private directory belongs unusable."""

    SYMLINK = "is a symlink"
    NOT_DIRECTORY = "is not a directory"
    FOREIGN_OWNER = "belongs to another user"
    OPEN_MODE = "is not mode 0700"


def defect(st: os.stat_result, uid: int) -> Defect | None:
    """The verdict on an lstat/fstat of a private directory (None: it is one)."""
    if stat.S_ISLNK(st.st_mode):
        return Defect.SYMLINK
    if not stat.S_ISDIR(st.st_mode):
        return Defect.NOT_DIRECTORY
    if st.st_uid != uid:
        return Defect.FOREIGN_OWNER
    if stat.S_IMODE(st.st_mode) != MODE:
        return Defect.OPEN_MODE
    return None


class PrivateDirError(UsageError):
    """A node-local directory of this project is not this user's private directory."""

    def __init__(self, path: Path, found: Defect, st: os.stat_result | None = None) -> None:
        if found is Defect.FOREIGN_OWNER and st is not None:
            what = f"belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
        elif found is Defect.OPEN_MODE and st is not None:
            what = f"has mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
        else:
            what = found.value
        if found is Defect.OPEN_MODE:
            fix = f"if it is yours, `chmod 700 {path}`; otherwise remove it"
        else:
            fix = ("something else made it (another user of this node?): remove it, or point "
                   "TMPDIR (or checkpoint.local_cache) elsewhere")
        super().__init__(f"{path} {what}: coordinator keeps this node's files of a run only "
                         f"in directories of this user's alone (mode 0700, no symlink); {fix}")
        self.path, self.defect = path, found


@dataclass(frozen=True)
class PrivateDir:
    """`names` made beneath `anchor`, a directory the user chose (or the job's TMPDIR)."""

    anchor: Path
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.names or any(n in ("", ".", "..") or "/" in n or "\0" in n
                                 for n in self.names):
            raise ValueError(f"{self.names!r} is not a list of plain directory names")

    @property
    def path(self) -> Path:
        return self.anchor.joinpath(*self.names)

    @property
    def parent(self) -> PrivateDir | None:
        """The directory holding this one when the project made it too (None: the anchor)."""
        return PrivateDir(self.anchor, self.names[:-1]) if len(self.names) > 1 else None

    def child(self, name: str) -> PrivateDir:
        return PrivateDir(self.anchor, (*self.names, name))


class _Vanished(Exception):
    """A directory of the walk was removed under it: walk again."""


def open_dir(place: PrivateDir, *, create: bool, parents: bool = True) -> int:
    """A descriptor (O_RDONLY) of `place`, every component checked, made when `create`:
    all of them, or with `parents=False` only the last (FileNotFoundError, naming the
    missing one, when another is gone)."""
    for _ in range(_ATTEMPTS - 1):
        try:
            return _walk(place, create=create, parents=parents)
        except _Vanished:
            continue
    try:
        return _walk(place, create=create, parents=parents)
    except _Vanished:
        raise FileNotFoundError(errno.ENOENT, "removed while it was being made",
                                str(place.path)) from None


def make(place: PrivateDir, *, parents: bool = True) -> Path:
    """Make `place` (and, with `parents`, the project's directories above it); its path."""
    os.close(open_dir(place, create=True, parents=parents))
    return place.path


@contextlib.contextmanager
def opened(place: PrivateDir, *, create: bool, parents: bool = True) -> Iterator[int]:
    fd = open_dir(place, create=create, parents=parents)
    try:
        yield fd
    finally:
        os.close(fd)


def open_child(dir_fd: int, name: str, path: Path, *, create: bool) -> int:
    """The private directory `name` in the directory `dir_fd` (whose path is path.parent),
    checked, and made when `create`."""
    made = False
    if create:
        try:
            os.mkdir(name, MODE, dir_fd=dir_fd)
            made = True
        except FileExistsError:
            pass
        except FileNotFoundError:
            raise _Vanished from None  # dir_fd's directory was removed meanwhile
    try:
        fd = os.open(name, _OPEN, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            st = os.lstat(name, dir_fd=dir_fd)
            raise PrivateDirError(path, defect(st, os.getuid()) or Defect.NOT_DIRECTORY,
                                  st) from None
        if exc.errno == errno.ENOENT:
            if create:
                raise _Vanished from None
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path)) from None
        raise
    try:
        if made:
            os.fchmod(fd, MODE)  # whatever the umask took away: the mode is ours to set
        st = os.fstat(fd)
        found = defect(st, os.getuid())
        if found is not None:
            raise PrivateDirError(path, found, st)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_anchor(anchor: Path, *, create: bool) -> int:
    """The anchor is the user's (TMPDIR, checkpoint.local_cache): followed if a symlink."""
    try:
        return os.open(anchor, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        if not create:
            raise
    os.makedirs(anchor, mode=MODE, exist_ok=True)
    return os.open(anchor, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _walk(place: PrivateDir, *, create: bool, parents: bool) -> int:
    fd = _open_anchor(place.anchor, create=create and parents)
    try:
        path = place.anchor
        for i, name in enumerate(place.names):
            path = path / name
            last = i == len(place.names) - 1
            child = open_child(fd, name, path, create=create and (parents or last))
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def same_directory(fd: int, path: Path) -> bool:
    """Whether `fd` is still the directory at `path` (not removed, not replaced)."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return False
    st = os.fstat(fd)
    return (found.st_dev, found.st_ino) == (st.st_dev, st.st_ino)


def empty(fd: int) -> None:
    """Remove everything in the directory `fd`, through descriptors: a symlink inside is
    removed, never followed."""
    for name in os.listdir(fd):
        beneath.remove_at(fd, name)


def remove(place: PrivateDir) -> bool:
    """rm -r of `place` that never follows a symlink; then its parent, if the project
    made it and nothing else is left there.  False when it was not there."""
    parent = place.parent
    try:
        holder = open_dir(parent, create=False) if parent else _open_anchor(place.anchor,
                                                                           create=False)
    except FileNotFoundError:
        return False
    try:
        removed = beneath.remove_at(holder, place.names[-1])
    finally:
        os.close(holder)
    if parent is not None:
        remove_if_empty(parent)
    return removed


def remove_if_empty(place: PrivateDir) -> None:
    """rmdir `place` when nothing is left in it (a base directory after its last run)."""
    parent = place.parent
    with contextlib.suppress(OSError):  # not empty (another run, a holder arriving), or gone
        holder = open_dir(parent, create=False) if parent else _open_anchor(place.anchor,
                                                                           create=False)
        try:
            os.rmdir(place.names[-1], dir_fd=holder)
        finally:
            os.close(holder)
