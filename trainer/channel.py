"""The node-local line between a daemon and the processes of its resident trainer.

The daemon listens on an abstract Unix socket (a random name: nothing on the
filesystem to leave behind or to find) and puts the name and a token in the
trainer's environment.  Each trainer process (one per local rank) connects
when it starts, proves itself with the token and its uid (SO_PEERCRED), and
then waits for work.  One JSON object per line:

    daemon -> trainer   {"op": "train", "job": PATH, "iteration": N}
                        {"op": "ping", "n": K}        answered at once when idle
                        {"op": "save"}                a clean stop: save the state
                                                      not yet saved, each rank alone
                        {"op": "stop"}
    trainer -> daemon   {"op": "hello", "token": T, "rank": R, "local_rank": L,
                         "world_size": W, "pid": P}
                        {"op": "done", "iteration": N, "seconds": S, "step": K,
                         "saved_through": M, "gpu_mib": G}
                        {"op": "failed", "iteration": N, "error": TEXT,
                         "peer": true when a peer of the group went away}
                        {"op": "pong", "n": K}
                        {"op": "saved", "iteration": N or null}

A line longer than `MAX_LINE`, or one that is not such an object, closes the
connection: either side then treats the other as gone.  Importing this
module does not import torch: the daemon uses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import struct
import threading
import time
from typing import Any, Final

SOCKET_ENV: Final = "COORDINATOR_TRAINER_SOCKET"
TOKEN_ENV: Final = "COORDINATOR_TRAINER_TOKEN"
# The initial model this node's daemon was configured with (model.path, or the run's
# built model): the one directory outside the run a job may read (trainer/worker.py).
MODEL_DIR_ENV: Final = "COORDINATOR_INITIAL_MODEL"
MAX_LINE: Final = 64 * 1024  # a failure message with its traceback's last lines fits
OPS: Final = frozenset({"train", "ping", "save", "stop", "hello", "done", "failed", "pong",
                        "saved"})


class ChannelClosed(ConnectionError):
    """The other side is gone, or sent something that is not a message."""


class Channel:
    """One connected socket: whole JSON lines out, whole JSON lines in."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = b""
        self._send_lock = threading.Lock()  # the daemon's watcher pings beside the main thread

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        if len(data) > MAX_LINE:
            raise ValueError(f"message of {len(data)} bytes is over the {MAX_LINE}-byte limit")
        try:
            with self._send_lock:
                self.sock.sendall(data)
        except OSError as exc:
            raise ChannelClosed(f"cannot send: {exc}") from exc

    def recv(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next message; None when `timeout` (seconds) passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_LINE:
                raise ChannelClosed(f"a line longer than {MAX_LINE} bytes")
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ready, _, _ = select.select([self.sock], [], [], wait)
            except (OSError, ValueError) as exc:  # ValueError: the socket was closed here
                raise ChannelClosed(f"cannot receive: {exc}") from exc
            if not ready:
                return None
            try:
                chunk = self.sock.recv(65536)
            except OSError as exc:
                raise ChannelClosed(f"cannot receive: {exc}") from exc
            if not chunk:
                raise ChannelClosed("the other side closed the connection")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return parse(line)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # an already broken socket: nothing to release
            self.sock.close()


def parse(line: bytes) -> dict[str, Any]:
    """A message, or ChannelClosed saying why the line is not one."""
    try:
        message = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ChannelClosed(f"a line that is not JSON: {exc}") from exc
    if not isinstance(message, dict) or message.get("op") not in OPS:
        raise ChannelClosed(f"not a message: {str(message)[:200]!r}")
    return message


def listen(name: str) -> socket.socket:
    """A listening abstract Unix socket named `name` (Linux)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("\0" + name)
    server.listen(64)
    return server


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end (SO_PEERCRED: pid, uid, gid)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", raw)[1])


def accept(server: socket.socket, timeout: float) -> Channel | None:
    """The next connection from a process of this user, or None after `timeout`."""
    ready, _, _ = select.select([server], [], [], timeout)
    if not ready:
        return None
    sock, _ = server.accept()
    if peer_uid(sock) != os.getuid():
        sock.close()  # another user's process on this node: never a trainer of ours
        return None
    return Channel(sock)


def connect(name: str, *, timeout: float = 10.0) -> Channel:
    """Connect to the daemon's socket (the trainer's side)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect("\0" + name)
    sock.settimeout(None)
    return Channel(sock)
