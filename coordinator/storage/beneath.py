"""Paths inside the run directory, resolved without ever following a symlink.

Anyone who can write the run directory (docs/PROTOCOL.md, threat model) can
plant a symlink where a daemon expects a directory or a file.  Resolving such
a path the usual way would let that writer steer a daemon's writes, appends
and deletes anywhere the daemon's user may write.  So a process declares its
run directory once (`confine`), and every operation of coordinator.storage.fsio on a
path inside it is resolved *beneath* the directory with no symlink in any
component:

    openat2(root_fd, "ranks/2/heartbeat.json", RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)

one system call on Linux 5.6 and newer; where openat2 is missing (older
kernels, seccomp filters that refuse it) the same rule is applied by opening
one component at a time with O_NOFOLLOW.  A path outside every confined root
(the node-local model cache, a test's scratch file) is opened normally, with
O_NOFOLLOW on its last component.

The root itself is trusted: it is what the operator typed on the command line.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Final

from coordinator.errors import UnsafeFileError

DIR_MODE: Final = 0o755
# Set by a daemon for the programs it starts (the trainer under torchrun):
# their run directory, to confine themselves to in turn.
RUN_DIR_ENV: Final = "COORDINATOR_RUN_DIR"
_CLOEXEC: Final = os.O_CLOEXEC
_SYS_OPENAT2: Final = 437  # the same number on every Linux architecture
_RESOLVE_NO_MAGICLINKS: Final = 0x02
_RESOLVE_NO_SYMLINKS: Final = 0x04
_RESOLVE_BENEATH: Final = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64))


class _Roots:
    """The confined run directories of this process and how to open beneath them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fds: dict[str, int] = {}  # absolute root (as given and as resolved) -> O_PATH fd
        self.openat2: bool | None = None  # None: not tried yet
        self._syscall = None

    def syscall(self):  # type: ignore[no-untyped-def]
        if self._syscall is None:
            libc = ctypes.CDLL(None, use_errno=True)
            self._syscall = libc.syscall
        return self._syscall


_ROOTS: Final = _Roots()


def confine(root: Path) -> None:
    """Resolve every later operation on a path under `root` beneath it, symlink-free."""
    absolute = os.path.abspath(root)
    fd = os.open(absolute, os.O_PATH | os.O_DIRECTORY | _CLOEXEC)
    with _ROOTS.lock:
        for name in {absolute, os.path.realpath(absolute)}:
            old = _ROOTS.fds.get(name)
            if old is not None and old != fd:
                with contextlib.suppress(OSError):  # closing our own descriptor
                    os.close(old)
            _ROOTS.fds[name] = fd


def release(root: Path) -> None:
    """Forget a confined root (tests; a daemon keeps its root for its lifetime)."""
    absolute = os.path.abspath(root)
    with _ROOTS.lock:
        fds = {_ROOTS.fds.pop(n, None) for n in (absolute, os.path.realpath(absolute))}
    for fd in fds - {None}:
        with contextlib.suppress(OSError):  # already closed by a second release
            os.close(fd)  # type: ignore[arg-type]


def use_openat2(enabled: bool | None) -> None:
    """Force the component walk (False) or re-detect (None); for tests of both paths."""
    _ROOTS.openat2 = enabled


def relative_inside(text: object, *, what: str, where: Path) -> PurePosixPath:
    """A relative path read from a record: no '..', not absolute, not empty.

    `where` is the file the text came from, for the error message.  Symlinks
    along the path are refused later, when it is opened beneath the root.
    """
    if not isinstance(text, str) or not text or "\0" in text or "\\" in text:
        raise UnsafeFileError(where, f"{what} {text!r} is not a relative path")
    path = PurePosixPath(text)
    if path.is_absolute() or any(part in ("..", ".") for part in path.parts) or \
            text != path.as_posix():
        raise UnsafeFileError(
            where, f"{what} {text!r} must be a plain relative path inside the run directory "
            "(no '..', not absolute)")
    return path


def _split(path: Path | str) -> tuple[int, str] | None:
    """(root fd, path relative to it) when `path` lies in a confined root, else None."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        text = os.path.join(os.getcwd(), text)
    parts = text.split("/")
    if ".." in parts:
        raise UnsafeFileError(Path(text), "the path contains '..'")
    if not _ROOTS.fds:
        return None
    normal = os.path.normpath(text)
    best = ""
    for root in _ROOTS.fds:
        if (normal == root or normal.startswith(root.rstrip("/") + "/")) and len(root) > len(best):
            best = root
    if not best:
        return None
    rel = normal[len(best):].lstrip("/")
    return _ROOTS.fds[best], rel or "."


def _describe_refusal(root_fd: int, rel: str, exc: OSError) -> str:
    """Which component is the symlink (or not a directory), for the error message."""
    current = ""
    for part in rel.split("/"):
        current = f"{current}/{part}" if current else part
        try:
            st = os.lstat(current, dir_fd=root_fd)
        except OSError:
            break
        if stat.S_ISLNK(st.st_mode):
            return f"{current} is a symlink: the run directory must hold no symlinks"
        if not stat.S_ISDIR(st.st_mode) and current != rel:
            return f"{current} is not a directory"
    return f"{os.strerror(exc.errno or 0)} while resolving it inside the run directory"


def _openat2(root_fd: int, rel: str, flags: int, mode: int) -> int:
    how = _OpenHow(flags | _CLOEXEC, mode if flags & os.O_CREAT else 0,
                   _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
    # syscall(2) is variadic: every argument goes as a full machine word.
    fd = _ROOTS.syscall()(ctypes.c_long(_SYS_OPENAT2), ctypes.c_long(root_fd),
                          ctypes.c_char_p(os.fsencode(rel)), ctypes.byref(how),
                          ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), rel)
    return int(fd)


def _walk(root_fd: int, rel: str, flags: int, mode: int) -> int:
    """openat2's rule by hand: one component at a time, none of them a symlink."""
    parts = rel.split("/")
    current = root_fd
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC,
                          dir_fd=current)
            if current != root_fd:
                os.close(current)
            current = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW | _CLOEXEC, mode, dir_fd=current)
    finally:
        if current != root_fd:
            os.close(current)


def _open_confined(root_fd: int, rel: str, flags: int, mode: int, path: Path | str) -> int:
    if _ROOTS.openat2 is not False:
        try:
            fd = _openat2(root_fd, rel, flags, mode)
            _ROOTS.openat2 = True
            return fd
        except OSError as exc:
            if exc.errno in (errno.ENOSYS, errno.EPERM, errno.E2BIG) and not _ROOTS.openat2:
                _ROOTS.openat2 = False  # not available here: walk from now on
            else:
                raise _named(exc, root_fd, rel, path) from None
    try:
        return _walk(root_fd, rel, flags, mode)
    except OSError as exc:
        raise _named(exc, root_fd, rel, path) from None


def _named(exc: OSError, root_fd: int, rel: str, path: Path | str) -> Exception:
    """The error to raise for a failed open beneath a root, naming the full path."""
    if exc.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR):
        # A symlink on the way, an escape, or a file where a directory belongs:
        # something planted, never a state the protocol produces.
        return UnsafeFileError(Path(path), _describe_refusal(root_fd, rel, exc))
    return OSError(exc.errno, exc.strerror, os.fspath(path))


def open_file(path: Path | str, flags: int, mode: int = 0o644) -> int:
    """os.open of a file, beneath its confined root when it has one; never through a symlink."""
    split = _split(path)
    if split is None:
        try:
            return os.open(path, flags | os.O_NOFOLLOW | _CLOEXEC, mode)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeFileError(Path(path), "is a symlink") from None
            raise
    root_fd, rel = split
    return _open_confined(root_fd, rel, flags, mode, path)


def open_dir(path: Path | str, *, create: bool = False) -> int:
    """An O_RDONLY descriptor of a directory (for *at calls and fsync), made if asked."""
    flags = os.O_RDONLY | os.O_DIRECTORY
    try:
        return open_file(path, flags)
    except FileNotFoundError:
        if not create:
            raise
    make_dirs(path)
    return open_file(path, flags)


def make_dirs(path: Path | str) -> None:
    """mkdir -p with mode 0755 whatever the umask, beneath the confined root."""
    text = os.path.normpath(os.path.abspath(os.fspath(path)))
    parent = os.path.dirname(text)
    if parent == text:
        return
    try:
        fd = open_file(parent, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        make_dirs(parent)
        fd = open_file(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            os.mkdir(os.path.basename(text), DIR_MODE, dir_fd=fd)
        except FileExistsError:
            return  # a concurrent creator (or it was there): fine
        # The umask may have taken bits away (or a caller's umask 000 may not):
        # the mode is the protocol's, not the environment's.
        made = os.open(os.path.basename(text), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                       | _CLOEXEC, dir_fd=fd)
        try:
            os.fchmod(made, DIR_MODE)
        finally:
            os.close(made)
    finally:
        os.close(fd)


@contextlib.contextmanager
def parent_dir(path: Path | str, *, create: bool) -> Iterator[tuple[int, str]]:
    """(descriptor of the parent directory, last component) for *at calls."""
    text = os.fspath(path)
    name = os.path.basename(text.rstrip("/"))
    if name in ("", ".", ".."):
        raise UnsafeFileError(Path(text), "is not a file name")
    fd = open_dir(os.path.dirname(os.path.abspath(text)), create=create)
    try:
        yield fd, name
    finally:
        os.close(fd)


def remove_tree(path: Path | str) -> bool:
    """rm -r that never follows a symlink (a symlink is removed, not its target)."""
    try:
        with parent_dir(path, create=False) as (fd, name):
            return remove_at(fd, name)
    except FileNotFoundError:
        return False


def remove_at(dir_fd: int, name: str) -> bool:
    """rm -r of `name` in the directory `dir_fd`; a symlink is removed, never followed."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(FileNotFoundError):  # removed concurrently
            os.unlink(name, dir_fd=dir_fd)
        return True
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC, dir_fd=dir_fd)
    try:
        with os.scandir(fd) as entries:
            names = [e.name for e in entries]
        for child in names:
            remove_at(fd, child)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=dir_fd)
    return True
