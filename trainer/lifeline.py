"""Tie a trainer process's life to its torchrun agent.

torchrun does not kill its workers when it is itself SIGKILLed, and a worker
left behind sits in its next collective until that times out, minutes later,
holding memory and a GPU.  This module imports nothing heavy so the daemon can
read LAUNCHER_PID_ENV without loading torch.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Final

log = logging.getLogger("trainer")

_PR_SET_PDEATHSIG: Final = 1  # from <linux/prctl.h>


LAUNCHER_PID_ENV: Final = "COORDINATOR_LAUNCHER_PID"
"""Set by the daemon to its own pid: the trainer's expected grandparent."""


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when our parent (torchrun) dies.

    The kernel sends it when the *thread* that forked us ends: torchrun's
    elastic agent starts and restarts its workers from its main thread
    (`_invoke_run`), which ends only with torchrun, so this is torchrun's
    death.  (The daemon's own children are forked by a thread that lives as
    long as the daemon: coordinator/machine/lifetime.py.)

    Without it a rank whose torchrun agent was killed keeps its process group
    and memory until its next collective times out, minutes later.  prctl only
    covers deaths after the call: a torchrun that died while this process was
    still starting has already left us reparented, which shows as a parent
    that is no longer the daemon's child (the daemon puts its pid in
    COORDINATOR_LAUNCHER_PID), and we exit at once.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    orphaned = os.getppid() != parent or (
        launcher.isdigit() and _parent_of(parent) != int(launcher))
    if orphaned:
        print(f"trainer pid {os.getpid()}: torchrun (pid {parent}) is gone; exiting",
              file=sys.stderr, flush=True)
        os._exit(1)


def _parent_of(pid: int) -> int | None:
    """The parent pid of `pid` per /proc, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the ")" that closes the command name: state, ppid, ...
    return int(stat.rsplit(")", 1)[1].split()[1])
