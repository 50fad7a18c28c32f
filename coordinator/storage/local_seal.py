"""The seal on a node's own copy of something: trusted for this machine's boot.

A node-local copy (a checkpoint in the node's cache, the publisher's last
published files) is read back only by processes on this machine.  What they read
is the page cache, where a write lands at once: a process killed mid-write
(SIGKILL, OOM) loses nothing that was written.  Only the machine going down
(power, a kernel panic) can leave a file on disk shorter or older than what was
read, and it takes a reboot with it.  So a copy need not be fsynced to be
trusted by this boot:

    written, not fsynced  -> sealed with this boot's id (Linux: the kernel's
                             random boot_id); trusted while the id is the same,
                             made again after a reboot
    written and fsynced   -> sealed as durable, trusted across reboots: where the
                             kernel names no boot (not Linux), every copy is made so

A copy without a seal, or with one that does not parse, is not trusted: the seal
is written last, so a copy cut short has none.  This saves a node the fsync of
every byte it caches (a whole model per iteration, a delta applied to a clone of
its parent's copy) on the update's path: `cp`, the floor the benchmarks measure
against, does not fsync either.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from pathlib import Path
from typing import Final

SEAL_NAME: Final = ".seal"  # in the sealed directory, beside what it seals
BOOT_ID: Final = Path("/proc/sys/kernel/random/boot_id")
DURABLE: Final = "durable"
_BOOT: Final = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@functools.cache
def boot_id() -> str | None:
    """This machine's boot (a UUID the kernel draws at each boot), or None where the
    kernel names none: then node-local copies are fsynced (`durable()`)."""
    try:
        text = BOOT_ID.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if _BOOT.fullmatch(text) else None


def durable() -> bool:
    """Whether a node-local copy must be fsynced before it is sealed: where no boot
    id tells a copy written before a reboot from one written since."""
    return boot_id() is None


def mark() -> str:
    """What a seal written now says: "boot <id>", or "durable" where no boot is named
    (the files fsynced first)."""
    boot = boot_id()
    return DURABLE if boot is None else f"boot {boot}"


def trusted(seal: object) -> bool:
    """Whether a seal's mark (`mark()` when written) may be trusted now: durable, or
    written in this boot."""
    return seal in (DURABLE, mark())


def write_seal(directory: Path) -> None:
    """Seal `directory`, whose files are written (and fsynced, where `durable()`):
    the last file written into it."""
    path = directory / SEAL_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(mark() + "\n")
        if durable():
            handle.flush()
            os.fsync(handle.fileno())


def sealed(directory: Path) -> bool:
    """Whether `directory` holds a seal this boot may trust: durable, or this boot's."""
    try:
        with open(directory / SEAL_NAME, "rb") as handle:
            text = handle.read(128).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return False
    return trusted(text)


def unseal(directory: Path) -> None:
    """Remove `directory`'s seal (before it is written again): until sealed anew, it
    is not trusted."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(directory / SEAL_NAME)
