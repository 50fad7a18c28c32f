"""A rename held at the file server: a node frozen exactly before it publishes a file.

A test that kills a node "while it writes X" must stop it after X's temporary file
exists and before its rename, the instant that decides whether X is published.
Freezing the writer when an inotify watch sees the temporary file is a race the
writer can win on a loaded machine (a small file's write, fsync and rename over
loopback take milliseconds).  Here the file server holds the rename instead: the
network filesystem fixture (tests/support/netfs.py) runs this script as its SFTP
subsystem, in front of OpenSSH's sftp-server, one process per mount.

    test (RenameGate)                         this script (per mount, in sshd)
    ─────────────────────────────────────     ──────────────────────────────────────
    arm(<part of the old path>) -> <gate>/arm
                                              a rename whose old path contains it:
                                              arm -> armed-<pid> (one proxy claims it),
                                              <gate>/held (the paths), the request kept
    held() true: the writer is blocked in
    rename(2); kill it, then drop()  -> <gate>/drop
                                              answers the request with a failure and
                                              never forwards it: the rename never was
    (or let_through() -> <gate>/pass)         forwards it

Every other request, and every answer, is relayed unchanged, a whole packet at a
time (SFTP: a 4-byte big-endian length, then a type byte and the body); while a
rename is held, the requests after it from the same mount wait behind it, as a
stalled file server's would.  The gate
fires once.  This file runs with sshd's environment and the project's Python, and
imports nothing from the project.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

SERVER = "/usr/lib/openssh/sftp-server"
RENAME, EXTENDED, STATUS = 18, 200, 101  # SSH_FXP_RENAME, SSH_FXP_EXTENDED, SSH_FXP_STATUS
FAILURE = 4  # SSH_FX_FAILURE
POSIX_RENAME = b"posix-rename@openssh.com"
HOLD_S = 600.0  # the longest a held rename waits for the test: then it goes through


def _read_exact(stream: object, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = stream.read(size - len(data))  # type: ignore[attr-defined]
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _packets(stream: object):  # type: ignore[no-untyped-def]
    """Whole SFTP packets (length prefix included) until the stream ends."""
    while True:
        try:
            head = _read_exact(stream, 4)
            yield head + _read_exact(stream, struct.unpack(">I", head)[0])
        except EOFError:
            return


def _string(body: bytes, at: int) -> tuple[bytes, int]:
    (size,) = struct.unpack(">I", body[at:at + 4])
    return body[at + 4:at + 4 + size], at + 4 + size


def rename_of(packet: bytes) -> tuple[int, bytes, bytes] | None:
    """(request id, old path, new path) of a rename request, else None."""
    kind, body = packet[4], packet[5:]
    try:
        (request,) = struct.unpack(">I", body[:4])
        at = 4
        if kind == EXTENDED:
            name, at = _string(body, at)
            if name != POSIX_RENAME:
                return None
        elif kind != RENAME:
            return None
        old, at = _string(body, at)
        new, _ = _string(body, at)
    except struct.error:
        return None
    return request, old, new


def status(request: int, message: bytes) -> bytes:
    body = struct.pack(">BII", STATUS, request, FAILURE) + struct.pack(">I", len(message)) \
        + message + struct.pack(">I", 0)
    return struct.pack(">I", len(body)) + body


class Proxy:
    def __init__(self, gate: Path) -> None:
        self.gate = gate
        self.out = sys.stdout.buffer
        self.lock = threading.Lock()  # one packet at a time to the client
        self.server = subprocess.Popen([SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def send(self, packet: bytes) -> None:
        with self.lock:
            self.out.write(packet)
            self.out.flush()

    def answers(self) -> None:
        for packet in _packets(self.server.stdout):
            self.send(packet)

    def requests(self) -> None:
        assert self.server.stdin is not None
        for packet in _packets(sys.stdin.buffer):
            rename = rename_of(packet)
            if rename is not None and self.claimed(rename[1]) and not self.hold(rename):
                continue  # dropped: answered, never forwarded
            self.server.stdin.write(packet)
            self.server.stdin.flush()
        self.server.stdin.close()

    def claimed(self, old: bytes) -> bool:
        """Whether this rename is the one the test armed the gate for (this proxy then
        owns the firing: no other mount's can take it)."""
        try:
            part = (self.gate / "arm").read_bytes()
        except OSError:
            return False
        if not part or part not in old:
            return False
        try:
            os.rename(self.gate / "arm", self.gate / f"armed-{os.getpid()}")
        except OSError:
            return False
        return True

    def hold(self, rename: tuple[int, bytes, bytes]) -> bool:
        """Keep the rename until the test's word; whether to forward it."""
        request, old, new = rename
        temporary = self.gate / f".held-{os.getpid()}"
        temporary.write_bytes(old + b"\n" + new + b"\n")
        os.rename(temporary, self.gate / "held")
        deadline = time.monotonic() + HOLD_S
        while time.monotonic() < deadline:
            if (self.gate / "drop").exists():
                self.send(status(request, b"the test dropped this rename"))
                return False
            if (self.gate / "pass").exists():
                return True
            time.sleep(0.01)
        return True


class RenameGate:
    """The test's side: a directory on the test's local disk, given to NetFs."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def arm(self, part: str) -> None:
        """Hold the next rename whose old path contains `part`."""
        temporary = self.directory / ".arm"
        temporary.write_text(part)
        os.rename(temporary, self.directory / "arm")

    def held(self) -> bool:
        return (self.directory / "held").exists()

    def held_paths(self) -> tuple[str, str]:
        old, new = (self.directory / "held").read_text().splitlines()[:2]
        return old, new

    def drop(self) -> None:
        """Answer the held rename with a failure; it never reaches the export."""
        (self.directory / "drop").touch()

    def let_through(self) -> None:
        (self.directory / "pass").touch()


def main() -> None:
    proxy = Proxy(Path(sys.argv[1]))
    answers = threading.Thread(target=proxy.answers, daemon=True)
    answers.start()
    proxy.requests()
    answers.join(timeout=30)
    proxy.server.wait(timeout=30)


if __name__ == "__main__":
    main()
