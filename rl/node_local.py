"""What a run keeps on each node's own disk, and when it goes.

    $TMPDIR/coordinator-<uid>/<run id>/     (or <checkpoint.local_cache>/<run id>/)
        <checkpoint>-<digest>/              verified copies of published checkpoints:
                                            the one served; older ones pruned (phase 12)
        .locks/<name>.lock                  flocks between this node's daemons of the run:
                                            one copies a checkpoint or builds the demo
                                            model, the others wait, then reuse it
        .holders/<pid>-<start time>         one per daemon of the run on this node
        .tmp/                               TMPDIR of the processes the daemons start
                                            (engines, torchrun and its workers): what
                                            they leave (torchelastic_*, compile caches)
                                            goes with the directory

Per user, under the temporary directory the job was given (TMPDIR, as Slurm
jobs expect): every directory here is this user's, mode 0700, and one found
otherwise (another user's, open to others, a symlink) is refused by name
(coordinator/storage/private_dir.py).  A bucket run directory's local root
(coordinator/storage/objstore.py) is held and removed the same way.

Every daemon that uses the directory registers as a holder; the last one to
leave (its daemon exiting, however it exits short of SIGKILL) removes the
whole directory, unless checkpoint.keep_local_cache.  A holder whose process
is gone (SIGKILL, a lost node coming back) does not count: the next daemon to
leave cleans up after it.  Registering and leaving hold a lock on the
directory itself (flock of its descriptor), so a daemon registering while the
last one leaves finds either the directory it registered in kept, or a new
one made after the old one went:

    hold:  open (make) dir -> flock -> still the dir at its path? -- no --> again
                                              | yes
                                              v
                                    .holders/<me> made, unlock
    leave: open dir -> flock -> .holders/<me> removed -> live holders? -- yes --> unlock
                                                              | no
                                                              v
                                    contents removed, dir removed, unlock

A directory that vanishes under a daemon that holds it (a TMPDIR cleaner,
`rm`) is named with that cause and made again at its next use.

One whose last daemon was SIGKILLed stays: nothing tells a run abandoned from
one between a kill and its restart, whose next daemon here reuses it.  Each
daemon, as it adopts its run's directory, names the directories of other runs
beside it that no live daemon holds, with their sizes (a WARNING), so that a
person can remove those of finished runs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import filelock
import psutil

from coordinator.errors import ActionError
from coordinator.records.bounds import check_run_id
from coordinator.storage import private_dir
from coordinator.storage.private_dir import PrivateDir

log = logging.getLogger(__name__)

HOLDERS: Final = ".holders"
LOCKS: Final = ".locks"
CHILD_TMP: Final = ".tmp"
# Leaving removes this node's copies of the run's checkpoints (a few GB of local
# disk: seconds); a registration waits for that, and no longer.
DIR_LOCK_TIMEOUT_S: Final = 120.0
_LOCK_POLL_S: Final = 0.02
_ATTEMPTS: Final = 5  # times a registration may find its directory removed under it
_LISTED: Final = 5  # unheld directories of other runs named in the warning, at most
_joined: dict[Path, PrivateDir] = {}  # the directories this process holds
_anchor: list[Path] = []  # TMPDIR as this process found it (adopt points TMPDIR inside)
_adopted: list[Path] = []  # the run directory whose .tmp is this process's TMPDIR


def _tmp_anchor() -> Path:
    if not _anchor:
        _anchor.append(Path(tempfile.gettempdir()))
    return _anchor[0]


def _base_name() -> str:
    return f"coordinator-{os.getuid()}"


def node_base() -> Path:
    """This user's directory in the node's temporary directory (TMPDIR honoured, as
    this process found it): made 0700, refused when it is not this user's alone."""
    return private_dir.make(PrivateDir(_tmp_anchor(), (_base_name(),)))


def run_place(run_id: str, local_cache: str = "") -> PrivateDir:
    """Where the run's directory on this node is."""
    check_run_id(run_id)  # it becomes a path
    if local_cache:
        return PrivateDir(Path(local_cache), (run_id,))
    return PrivateDir(_tmp_anchor(), (_base_name(), run_id))


def run_root(run_id: str, local_cache: str = "") -> Path:
    """The run's directory on this node, with this process registered as a holder."""
    return hold(run_place(run_id, local_cache))


def hold(place: PrivateDir) -> Path:
    """Register this process as a holder of a node-local directory of the run (its
    cache, or a bucket run directory's local root: coordinator/storage/objstore.py); the
    last holder to leave removes it (leave_all)."""
    root = place.path
    known = root in _joined
    if known and (root / HOLDERS / _me()).is_file():
        return root
    for _ in range(_ATTEMPTS):
        with private_dir.opened(place, create=True) as fd:
            _lock(fd, root, "registering")
            if not private_dir.same_directory(fd, root):
                continue  # the last holder removed it after we opened it: make it again
            holders = private_dir.open_child(fd, HOLDERS, root / HOLDERS, create=True)
            try:
                os.close(os.open(_me(), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, 0o600, dir_fd=holders))
            finally:
                os.close(holders)
            if root in _adopted:
                os.close(private_dir.open_child(fd, CHILD_TMP, root / CHILD_TMP, create=True))
            break
    else:
        raise ActionError(f"{root} was removed {_ATTEMPTS} times while this daemon registered "
                          "in it: what keeps removing it? (a TMPDIR cleaner, a script)")
    if known:
        log.warning("this node's directory of the run %s vanished while this daemon held it "
                    "(its daemons remove it only once none holds it: a TMPDIR cleaner such as "
                    "systemd-tmpfiles or tmpwatch, or someone, removed it): made again; keep "
                    "cleaners away from coordinator-* or set checkpoint.local_cache", root)
    _joined[root] = place
    return root


def adopt(run_id: str, local_cache: str = "") -> Path:
    """For a daemon's process, once it knows its run: hold the run's directory and
    make its .tmp the TMPDIR of this process and of every process it starts
    (the engines, torchrun and its workers), so that the temporary files they
    leave (torch's compile caches, torchrun's log directories) go with it.
    Changes this process's environment: call it from a daemon's entry point,
    never from a library or a test's process."""
    _tmp_anchor()  # fixed first: TMPDIR is about to name a directory inside it
    root = run_root(run_id, local_cache)
    tmp = private_dir.make(_joined[root].child(CHILD_TMP), parents=False)
    _adopted.append(root)
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = None  # this process's own temporary files follow
    try:
        warn_unheld_runs(root)
    except OSError as exc:  # a hint for the operator: never a reason not to start
        log.info("could not look for directories of other runs beside %s: %s", root, exc)
    return root


def unheld_runs(root: Path) -> list[tuple[Path, int]]:
    """The directories of other runs beside `root` (this run's, held) that no live
    daemon holds, with the bytes of their files: each was left by a daemon killed
    (SIGKILL, a lost node) as the last of its run on this node, or kept by
    checkpoint.keep_local_cache.  Read-only: one of them may be a run between a kill
    and its restart, whose next daemon here reuses it, so only a person may say it
    is over.  A sibling without .holders is not a run's directory and is not looked at."""
    found = []
    for sibling in sorted(root.parent.iterdir()):
        holders = sibling / HOLDERS
        if sibling == root or sibling.is_symlink() or not holders.is_dir():
            continue
        try:
            if any(_alive(name) for name in os.listdir(holders)):
                continue
        except FileNotFoundError:  # removed meanwhile by its own run's daemon leaving
            continue
        found.append((sibling, _tree_bytes(sibling)))
    return found


def _tree_bytes(top: Path) -> int:
    total = 0
    for where, _, files in os.walk(top):  # never into a symlinked directory
        for name in files:
            # Removed meanwhile by its own run's daemon leaving: it no longer counts.
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(where, name)).st_size
    return total


def warn_unheld_runs(root: Path) -> None:
    """Log the directories of runs no daemon holds beside `root`, with their sizes and
    what to do: a run abandoned after SIGKILL keeps its copies of whole models here."""
    unheld = unheld_runs(root)
    if not unheld:
        return
    total = sum(size for _, size in unheld)
    listed = ", ".join(f"{path} ({size / 2**20:,.1f} MiB)" for path, size in unheld[:_LISTED])
    more = f" and {len(unheld) - _LISTED} more" if len(unheld) > _LISTED else ""
    count = "1 directory" if len(unheld) == 1 else f"{len(unheld)} directories"
    log.warning("this node keeps %s of runs that no daemon holds, %s MiB in all: %s%s. "
                "Each was left by a daemon killed as the last of its run on this node "
                "(SIGKILL, a lost node), or kept by checkpoint.keep_local_cache; a run's next "
                "daemon here reuses its own. Remove those of finished runs (rm -rf DIR), or "
                "give each job its own TMPDIR", count, f"{total / 2**20:,.1f}", listed, more)


def lock_dir(root: Path) -> Path:
    """The run directory's .locks (made if missing); the run directory must be held."""
    place = _joined.get(root)
    if place is None:
        raise ValueError(f"{root} is not a directory this process holds (run_root first)")
    try:
        return private_dir.make(place.child(LOCKS), parents=False)
    except FileNotFoundError:
        raise vanished(root) from None


def vanished(root: Path) -> ActionError:
    return ActionError(
        f"this node's directory of the run {root} vanished while this daemon held it: "
        "its daemons remove it only once none holds it, so something else removed it (a "
        "TMPDIR cleaner such as systemd-tmpfiles or tmpwatch, or someone by hand); keep "
        "cleaners away from coordinator-* directories or set checkpoint.local_cache")


@contextlib.contextmanager
def node_lock(directory: Path, name: str, *, timeout_s: float, what: str) -> Iterator[None]:
    """Hold this node's lock `name` in `directory` (lock_dir of a run) for the block,
    waiting at most `timeout_s`.  Between the daemons of one node only: nothing on
    the shared run directory depends on a lock (docs/PROTOCOL.md, rule 3).

    filelock makes a missing parent directory again (with the umask's mode): a
    directory that vanished between our look and the lock is told apart by its
    inode, what filelock made is removed, and the vanishing is named.  The look is
    an open descriptor, held until the lock is checked: a removed directory's inode
    number is free for the next one made (ext4 and overlayfs give it again at once),
    unless something still holds it open."""
    path = directory / f"{name}.lock"
    try:
        held = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise vanished(directory.parent) from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ActionError(
                f"{directory} is no longer a directory (a symlink or a file took its place): "
                "this node's locks are never taken through one; remove it, and the run's "
                "daemons make it again") from None
        raise local_disk_error(exc, directory) from None
    try:
        lock = filelock.FileLock(path, mode=0o600, timeout=timeout_s)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise ActionError(
                f"waited {timeout_s:g} s for another process on this node to finish {what} "
                f"(lock file {path}): is a daemon of this run stuck?") from None
        except OSError as exc:
            raise local_disk_error(exc, path) from None
        if not private_dir.same_directory(held, directory):
            lock.release()
            # Only filelock's lock file can be in a directory made a moment ago.
            with contextlib.suppress(OSError):
                path.unlink()
                directory.rmdir()
            raise vanished(directory.parent)
    finally:
        os.close(held)
    try:
        yield
    finally:
        lock.release()


def local_disk_error(exc: OSError, path: Path) -> ActionError:
    """A node-local write that failed, naming the disk and the fix."""
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return ActionError(f"cannot write {path} on this node's disk: {exc.strerror} ({name}): "
                       "free space there, or point TMPDIR (or checkpoint.local_cache) at a "
                       "disk with room")


def leave_all(*, keep: bool) -> None:
    """At daemon exit: stop holding every run directory; the last holder removes it.
    A shutdown path: logs what fails, never raises."""
    for root, place in sorted(_joined.items()):
        try:
            leave(place, keep=keep)
        except OSError as exc:
            log.error("could not remove this node's directory of the run %s: %s", root, exc)
        except Exception as exc:
            log.error("did not remove this node's directory of the run %s: %s", root, exc)
    _joined.clear()
    _adopted.clear()


def leave(place: PrivateDir, *, keep: bool) -> None:
    """Stop holding `place`; remove it when no live daemon holds it any more.  Never
    through a symlink: one found there is refused (PrivateDirError), not followed."""
    root = place.path
    try:
        fd = private_dir.open_dir(place, create=False)
    except FileNotFoundError:
        log.warning("this node's directory of the run %s had vanished when this daemon left "
                    "(removed by something other than its daemons: a TMPDIR cleaner?)", root)
        return
    try:
        _lock(fd, root, "leaving")
        if not private_dir.same_directory(fd, root):
            return
        try:
            holders = private_dir.open_child(fd, HOLDERS, root / HOLDERS, create=False)
        except FileNotFoundError:
            holders = None
        if holders is not None:
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_me(), dir_fd=holders)
                if keep or _live_holders(holders):
                    return
            finally:
                os.close(holders)
        elif keep:
            return
        private_dir.empty(fd)
        parent = place.parent
        with private_dir.opened(parent, create=False) if parent else \
                _anchor_fd(place.anchor) as parent_fd:
            os.rmdir(place.names[-1], dir_fd=parent_fd)  # still locked: a holder waits
    finally:
        os.close(fd)
    if parent is not None:
        private_dir.remove_if_empty(parent)  # this user's last run on the node
    log.info("removed this node's directory of the run: %s", root)


@contextlib.contextmanager
def _anchor_fd(anchor: Path) -> Iterator[int]:
    fd = os.open(anchor, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def _lock(fd: int, root: Path, doing: str) -> None:
    """flock the directory `fd` (released when it is closed), waiting a bounded time."""
    if not _flock(fd, DIR_LOCK_TIMEOUT_S):
        raise ActionError(
            f"waited {DIR_LOCK_TIMEOUT_S:g} s to lock {root} for {doing}: another daemon of "
            "this run on this node holds it (registering, or removing the directory as the "
            "last to leave); is one stuck?")


def _flock(fd: int, timeout_s: float) -> bool:
    """An exclusive flock of `fd` within `timeout_s`; False when it stayed held."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(_LOCK_POLL_S)


def _me() -> str:
    me = psutil.Process()
    return f"{me.pid}-{int(me.create_time() * 1000)}"


def _alive(holder: str) -> bool:
    """Whether the process a holder's name (<pid>-<start time in ms>) names still runs."""
    pid, _, started = holder.partition("-")
    try:
        return int(started) == int(psutil.Process(int(pid)).create_time() * 1000)
    except (ValueError, psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _live_holders(holders: int) -> list[str]:
    """The live holders registered in the directory `holders`; stale ones removed."""
    live = []
    for name in os.listdir(holders):
        if _alive(name):
            live.append(name)
        else:
            with contextlib.suppress(FileNotFoundError):  # another leaver removed it first
                os.unlink(name, dir_fd=holders)
    return live
