"""A second, unprivileged user of this machine, for tests of what one local user can
do to another's runs (shared /tmp).  Needs root: the caller says so when it is not."""

from __future__ import annotations

import pwd
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OTHER_USER = "coordinator-test"


def other_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/sh",
                        OTHER_USER], check=True, capture_output=True, timeout=60)
        return pwd.getpwnam(OTHER_USER)


def as_other_user(user: str, cmd: list[str], *, hide: Path) -> list[str]:
    """`cmd` run as `user`.  The interpreter, the virtual environment or this checkout
    may lie under a directory only root can enter (pyenv under /root, a CI
    workspace): then, in a mount namespace of the command's own, each such
    directory is a world-readable tmpfs holding just what the run needs."""
    needed = sorted({Path(p).resolve() for p in (sys.base_prefix, sys.prefix, ROOT)})
    steps: list[str] = []
    covered: set[Path] = set()
    for i, path in enumerate(needed):
        blocked = next((d for d in reversed(path.parents) if d != Path("/") and
                        not d.stat().st_mode & 0o001), None)
        if blocked is None:
            continue
        keep = hide / str(i)
        keep.mkdir(parents=True, exist_ok=True)
        steps.append(f"mount --bind {path} {keep}")
        covered.add(blocked)
    if not steps:
        return ["runuser", "-u", user, "--", *cmd]
    for blocked in sorted(covered, key=lambda d: len(d.parts)):
        steps.append(f"mount -t tmpfs -o mode=755 tmpfs {blocked}")
    for i, path in enumerate(needed):
        if (hide / str(i)).exists():
            steps.append(f"mkdir -p {path} && mount --bind {hide / str(i)} {path}")
    script = " && ".join(["mount --make-rprivate /", *steps,
                          f'exec runuser -u {user} -- "$@"'])
    return ["unshare", "-m", "sh", "-c", script, "sh", *cmd]
