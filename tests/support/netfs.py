"""A network filesystem on loopback: one export, several client mounts.

sshd serves a tmp directory on a loopback port; sshfs mounts it several
times, one mount per simulated node.  Each mount is its own FUSE client with
its own kernel attribute and dentry caches and sshfs's own directory cache,
so a file one "node" writes is seen by another only through the server, with
caching like an NFS client's:

- attributes (size, mtime) cached by the kernel for `attr_timeout`, so
  stat() and exists() answer from the cache (NFS: acregmin..acregmax),
- names cached for `entry_timeout` (NFS: the dentry cache),
- directory listings cached by sshfs for `dcache_dir_timeout` (NFS:
  acdirmin..acdirmax), so a listing misses other clients' new files,
- failed lookups cached for `negative_timeout`: 0 by default, as on an NFS
  mount with `lookupcache=positive`; `negative_timeout_s > 0` caches them
  like NFS's default `lookupcache=all` (see docs/PROTOCOL.md, start-up),
- with `direct_io` (the default) open()+read() reaches the server, as NFS
  close-to-open consistency guarantees.  Without it (`direct_io=False`, the
  "plain caching" mode, as sshfs and many FUSE clients mount by default) the
  kernel caches data and cuts a read at the cached size: a file replaced by
  rename on another client reads short until the attributes expire, unless
  the reader asks the server again (coordinator/storage/fsio.py `revalidate`).

The setup needs root, /dev/fuse, sshd and sshfs (scripts/setup_test.sh installs
them); when it cannot be set up, `NetFsUnavailable` says why, and tests fail
with that reason rather than skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.support import fuse

SSHD = "/usr/sbin/sshd"


class NetFsUnavailable(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NetFs:
    def __init__(self, base: Path, *, mounts: int, cache_s: float = 30.0,
                 negative_timeout_s: float = 0.0, direct_io: bool = True,
                 rename_gate: Path | None = None) -> None:
        self.base = base
        self.export = base / "export"
        self.mounts = [base / f"client{i}" for i in range(mounts)]
        self.cache_s = cache_s
        self.negative_timeout_s = negative_timeout_s
        self.direct_io = direct_io
        # With a gate directory, the server can hold one rename for the test
        # (tests/support/sftp_gate.py), in front of OpenSSH's sftp-server.
        self.rename_gate = rename_gate
        self._sshd: subprocess.Popen[bytes] | None = None
        self._mounted: list[Path] = []

    def check(self) -> None:
        problems = []
        if os.geteuid() != 0:
            problems.append("not root (FUSE mounts and sshd need root here)")
        if not Path("/dev/fuse").exists():
            problems.append("/dev/fuse is missing")
        if not Path(SSHD).exists():
            problems.append(f"{SSHD} is missing (apt-get install openssh-server)")
        if shutil.which("sshfs") is None:
            problems.append("sshfs is missing (apt-get install sshfs)")
        if shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
            problems.append("fusermount is missing (apt-get install fuse3)")
        if problems:
            raise NetFsUnavailable("network filesystem fixture unavailable: " + "; ".join(problems)
                                   + " - run scripts/setup_test.sh as root")

    def __enter__(self) -> NetFs:
        self.check()
        keys = self.base / "keys"
        keys.mkdir(parents=True)
        self.export.mkdir()
        for key in ("host", "user"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / key)],
                           check=True)
        (keys / "authorized_keys").write_text((keys / "user.pub").read_text())
        port = _free_port()
        config = keys / "sshd_config"
        config.write_text(
            f"Port {port}\nListenAddress 127.0.0.1\nHostKey {keys / 'host'}\n"
            f"AuthorizedKeysFile {keys / 'authorized_keys'}\nPasswordAuthentication no\n"
            "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
            f"PidFile {keys / 'sshd.pid'}\nSubsystem sftp {self._sftp_subsystem()}\n"
            "MaxStartups 100\n"
        )
        Path("/run/sshd").mkdir(exist_ok=True)
        self._sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if self._sshd.poll() is not None or time.monotonic() > deadline:
                    err = self._sshd.stderr.read().decode() if self._sshd.stderr else ""
                    self.__exit__(None, None, None)
                    raise NetFsUnavailable(f"sshd did not start on port {port}: {err}") from None
                time.sleep(0.05)
        c = self.cache_s
        options = ",".join([
            f"IdentityFile={keys / 'user'}", "StrictHostKeyChecking=no",
            "UserKnownHostsFile=/dev/null", "LogLevel=ERROR",
            "dir_cache=yes", f"dcache_dir_timeout={c:g}", "dcache_stat_timeout=0",
            f"entry_timeout={c:g}", f"attr_timeout={c:g}",
            f"negative_timeout={self.negative_timeout_s:g}",
            *(["direct_io"] if self.direct_io else []),
        ])
        for mount in self.mounts:
            mount.mkdir()
            result = subprocess.run(
                ["sshfs", "-p", str(port), "-o", options, f"root@127.0.0.1:{self.export}",
                 str(mount)], capture_output=True, text=True, timeout=30)
            if result.returncode != 0:
                self.__exit__(None, None, None)
                raise NetFsUnavailable(f"sshfs mount of {mount} failed: {result.stderr.strip()}")
            self._mounted.append(mount)
        return self

    def _sftp_subsystem(self) -> str:
        if self.rename_gate is None:
            return "internal-sftp"
        gate = Path(__file__).with_name("sftp_gate.py")
        return f"{sys.executable} {gate} {self.rename_gate}"

    def __exit__(self, *exc: object) -> None:
        for mount in self._mounted:
            fuse.unmount(mount)
        self._mounted.clear()
        if self._sshd is not None:
            fuse.stop(self._sshd)
            self._sshd = None
