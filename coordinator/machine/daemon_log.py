"""Each daemon's log in its rank's directory of the run: ranks/<R>/logs/daemon.log.

Under sbatch the nodes' stderr ends in one job output file (or in files on
the node that launched the job); in the run directory each rank's log stands
apart, where `coordinator status` points to it, beside the logs of the
daemon's children (engine, trainer).  Each record is appended on its own,
without following a symlink (fsio.open_append), by every daemon that holds
the rank in turn (a restart appends, after a line naming its process).  In a bucket it is a node-local
file of the local root, sent as an object with the children's logs at every
iteration's end and when the daemon exits (rl/reporting.py, coordinator_cli/app.py).

A write that fails (a full disk) stops the file and says so once on stderr,
naming the file and the error; the daemon goes on, and its stderr keeps the
whole log.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Final

from coordinator import routing
from coordinator.errors import CoordinatorError
from coordinator.records import layout
from coordinator.storage import fsio

NAME: Final = "daemon.log"


def path(run_dir: Path, rank: int) -> Path:
    return run_dir / layout.logs(rank) / NAME


class RunDirHandler(logging.Handler):
    """Appends each record to the log file, opened for that record only: no descriptor
    stays open on the shared filesystem (a remount read-only would be refused while
    one is), and a record goes to the file at its path, even one moved or removed
    meanwhile.  Stops at the first failed write."""

    def __init__(self, where: Path) -> None:
        super().__init__()
        self.where = where
        self.broken: OSError | CoordinatorError | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.broken is not None:
            return
        try:
            data = (self.format(record) + "\n").encode("utf-8", "replace")
            fd = fsio.open_append(self.where)
            try:
                while data:
                    data = data[os.write(fd, data):]
            finally:
                os.close(fd)
        except (OSError, CoordinatorError) as exc:
            self.broken = exc
            sys.stderr.write(f"could not write this daemon's log {routing.display(self.where)}: "
                             f"{describe(exc)}; the log goes on on stderr only\n")


def describe(exc: OSError | CoordinatorError) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{exc.strerror} ({errno.errorcode.get(exc.errno, str(exc.errno))})"
    return str(exc)


def attach(run_dir: Path, rank: int, form: str) -> RunDirHandler:
    """Send this process's log records to rank `rank`'s log in `run_dir` too, in the
    format `form`."""
    handler = RunDirHandler(path(run_dir, rank))
    handler.setFormatter(logging.Formatter(form))
    logging.getLogger().addHandler(handler)
    logging.getLogger(__name__).info("rank %d, pid %d on %s: this log is also in %s", rank,
                                     os.getpid(), socket.gethostname(),
                                     routing.display(handler.where))
    return handler
