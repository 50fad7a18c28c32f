"""An object-store FUSE mount on this host: `rclone mount` of a local directory.

rclone (Debian's package; scripts/setup_test.sh installs it) serves a directory
through its VFS layer with `--vfs-cache-mode writes`, as people mount a bucket
with it: a rename is a copy and a delete, and link(2) fails with EIO.  Needs
root and /dev/fuse; `RcloneUnavailable` says why it could not be mounted, and
tests fail with that reason rather than skip.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from tests.support import fuse

MOUNT_TIMEOUT_S = 20.0  # rclone's start on a loaded 2-core machine


class RcloneUnavailable(RuntimeError):
    pass


def mounted(point: Path) -> bool:
    return any(line.split()[4] == str(point)
               for line in Path("/proc/self/mountinfo").read_text().splitlines())


class RcloneMount:
    def __init__(self, base: Path) -> None:
        self.source, self.point = base / "bucket", base / "mnt"
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RcloneMount:
        exe = shutil.which("rclone")
        if exe is None:
            raise RcloneUnavailable("rclone is not installed: run scripts/setup_test.sh as root")
        if not Path("/dev/fuse").exists():
            raise RcloneUnavailable("/dev/fuse is missing: FUSE mounts are impossible here")
        self.source.mkdir(parents=True)
        self.point.mkdir(parents=True)
        log = self.point.parent / "rclone.log"
        with log.open("wb") as out:
            self._proc = subprocess.Popen(
                [exe, "mount", f":local:{self.source}", str(self.point), "--vfs-cache-mode",
                 "writes", "--cache-dir", str(self.point.parent / "cache")],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not mounted(self.point):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RcloneUnavailable(f"rclone mount failed: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        if mounted(self.point):
            fuse.unmount(self.point)
        if self._proc is not None:
            fuse.stop(self._proc)
