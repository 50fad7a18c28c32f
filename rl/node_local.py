"""What a run keeps on each node's own disk, and when it goes.

    $TMPDIR/coordinator-<uid>/<run id>/     (or <checkpoint.local_cache>/<run id>/)
        <checkpoint>-<digest>/              verified copies of published checkpoints:
                                            the one served; older ones pruned (phase 12)
        .locks/<name>.lock                  locks between this node's daemons of the run:
                                            one copies a checkpoint or builds the demo
                                            model, the others wait, then reuse it
        .holders/<pid>-<start time>         one per daemon of the run on this node
        .tmp/                               TMPDIR of the processes the daemons start
                                            (engines, torchrun and its workers): what
                                            they leave (torchelastic_*, compile caches)
                                            goes with the directory

Per user, under the temporary directory the job was given (TMPDIR, as Slurm
jobs expect): a second user's run on a shared node never meets directories
the first user owns, and the base directory is created 0700 and refused when
someone else owns it.  Every daemon that uses the directory registers as a
holder; the last one to leave (its daemon exiting, however it exits short of
SIGKILL) removes the whole directory, unless checkpoint.keep_local_cache.
A holder whose process is gone (SIGKILL, a lost node coming back) does not
count: the next daemon to leave cleans up after it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import filelock
import psutil

from coordinator.errors import ActionError, UsageError
from coordinator.records import check_run_id

log = logging.getLogger(__name__)

HOLDERS = ".holders"
LOCKS = ".locks"
CHILD_TMP = ".tmp"
_joined: set[Path] = set()  # the run directories this process holds
_base: list[Path] = []  # node_base, fixed at its first use (TMPDIR later points inside)


def _base_path() -> Path:
    if not _base:
        _base.append(Path(tempfile.gettempdir()) / f"coordinator-{os.getuid()}")
    return _base[0]


def node_base() -> Path:
    """This user's directory in the node's temporary directory (TMPDIR honoured, as
    this process found it)."""
    base = _base_path()
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    owner = base.stat().st_uid
    if owner != os.getuid():
        raise UsageError(f"{base} belongs to uid {owner}, not to this user ({os.getuid()}): "
                         "something else made it; remove it, or point TMPDIR elsewhere")
    return base


def run_root(run_id: str, local_cache: str = "") -> Path:
    """The run's directory on this node, with this process registered as a holder."""
    check_run_id(run_id)  # it becomes a path
    return hold((Path(local_cache) if local_cache else node_base()) / run_id)


def hold(root: Path) -> Path:
    """Register this process as a holder of a node-local directory of the run (its
    cache, or a bucket run directory's local root: coordinator/objstore.py); the
    last holder to leave removes it (leave_all)."""
    holder = root / HOLDERS / _me()
    if root not in _joined or not holder.exists():
        (root / HOLDERS).mkdir(mode=0o700, parents=True, exist_ok=True)
        holder.touch()
        _joined.add(root)
    return root


def adopt(run_id: str, local_cache: str = "") -> Path:
    """For a daemon's process, once it knows its run: hold the run's directory and
    make its .tmp the TMPDIR of this process and of every process it starts
    (the engines, torchrun and its workers), so that the temporary files they
    leave (torch's compile caches, torchrun's log directories) go with it.
    Changes this process's environment: call it from a daemon's entry point,
    never from a library or a test's process."""
    _base_path()  # fixed first: TMPDIR is about to name a directory inside it
    root = run_root(run_id, local_cache)
    tmp = root / CHILD_TMP
    tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = None  # this process's own temporary files follow
    return root


def lock_dir(root: Path) -> Path:
    path = root / LOCKS
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def node_lock(directory: Path, name: str, *, timeout_s: float, what: str) -> Iterator[None]:
    """Hold this node's lock `name` in `directory` (lock_dir of a run) for the block,
    waiting at most `timeout_s`.  Between the daemons of one node only: nothing on
    the shared run directory depends on a lock (docs/PROTOCOL.md, rule 3)."""
    path = directory / f"{name}.lock"
    try:
        with filelock.FileLock(path, timeout=timeout_s):
            yield
    except filelock.Timeout:
        raise ActionError(
            f"waited {timeout_s:g} s for another process on this node to finish {what} "
            f"(lock file {path}): is a daemon of this run stuck? If none runs, remove the "
            "lock file") from None


def leave_all(*, keep: bool) -> None:
    """At daemon exit: stop holding every run directory; the last holder removes it.
    A shutdown path: logs what fails, never raises."""
    for root in sorted(_joined):
        try:
            leave(root, keep=keep)
        except Exception:
            log.exception("removing this node's directory of the run %s failed", root)
    _joined.clear()


def leave(root: Path, *, keep: bool) -> None:
    """Stop holding `root`; remove it when no live daemon holds it any more."""
    with contextlib.suppress(FileNotFoundError):
        (root / HOLDERS / _me()).unlink()
    if keep or not root.is_dir():
        return
    with node_lock(lock_dir(root), "cache", timeout_s=60.0, what="cleaning the node cache"):
        if _live_holders(root):
            return
        for child in root.iterdir():
            if child.name == LOCKS:
                continue
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
    # Outside the lock, whose file goes with it.  A daemon of this run starting
    # here at this instant recreates what it needs (run_root, lock_dir); at
    # worst two of its copies could then race, which verify-then-rename makes
    # harmless (trainer/checkpoint.py).
    shutil.rmtree(root / LOCKS, ignore_errors=True)
    with contextlib.suppress(OSError):  # a holder arrived meanwhile: it stays
        root.rmdir()
        if _base and root.parent == _base[0]:
            root.parent.rmdir()  # this user's last run on the node: nothing left
    log.info("removed this node's cache of the run: %s", root)


def _me() -> str:
    me = psutil.Process()
    return f"{me.pid}-{int(me.create_time() * 1000)}"


def _live_holders(root: Path) -> list[str]:
    live = []
    for holder in (root / HOLDERS).glob("*"):
        pid, _, started = holder.name.partition("-")
        try:
            alive = int(started) == int(psutil.Process(int(pid)).create_time() * 1000)
        except (ValueError, psutil.NoSuchProcess, psutil.AccessDenied):
            alive = False
        if alive:
            live.append(holder.name)
        else:
            holder.unlink(missing_ok=True)
    return live
