"""Taking down a FUSE mount the tests made, and the process serving it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def unmount(point: Path) -> None:
    """Lazy unmount (a process of a killed test may still hold a file there)."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount") or "umount"
    subprocess.run([tool, "-u", "-z", str(point)], capture_output=True, timeout=30, check=False)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s; always reaped."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
