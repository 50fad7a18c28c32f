"""Locks between the processes of one node, for what one node fills once and shares.

Several daemons on one host (the demo's simulated nodes, or one daemon per
GPU group) share the node-local checkpoint cache and may all want the demo
model built: a `filelock` lock in the node's temporary directory makes one
of them do the work while the others wait, then reuse it.  These locks never
guard anything on the shared run directory: the protocol there depends on no
lock (docs/PROTOCOL.md, rule 3).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import filelock

from coordinator.errors import ActionError


def lock_path(resource: Path) -> Path:
    """The node-local lock file of `resource` (any path; named by its absolute path)."""
    key = hashlib.sha256(os.path.abspath(resource).encode()).hexdigest()[:24]
    directory = Path(tempfile.gettempdir()) / "coordinator-locks"
    directory.mkdir(mode=0o755, exist_ok=True)
    return directory / f"{key}.lock"


@contextlib.contextmanager
def node_lock(resource: Path, *, timeout_s: float, what: str) -> Iterator[None]:
    """Hold this node's lock of `resource` for the block, waiting at most `timeout_s`."""
    path = lock_path(resource)
    try:
        with filelock.FileLock(path, timeout=timeout_s):
            yield
    except filelock.Timeout:
        raise ActionError(
            f"waited {timeout_s:g} s for another process on this node to finish {what} "
            f"({resource}; lock file {path}): is a daemon of this run stuck? If none runs, "
            "remove the lock file") from None
