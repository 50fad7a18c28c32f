"""The node-local channel between a daemon and its resident trainer's processes."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import threading
import time

import pytest

from trainer.channel import MAX_LINE, Channel, ChannelClosed, accept, connect, listen, parse


def pair() -> tuple[Channel, Channel]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Channel(a), Channel(b)


def test_messages_cross_whole_in_order_and_a_timeout_returns_none() -> None:
    daemon, trainer = pair()
    daemon.send({"op": "train", "job": "/run/iterations/000003/train/job.json", "iteration": 3})
    daemon.send({"op": "ping", "n": 7})
    assert trainer.recv(timeout=1) == {"op": "train",
                                       "job": "/run/iterations/000003/train/job.json",
                                       "iteration": 3}
    assert trainer.recv(timeout=1) == {"op": "ping", "n": 7}
    assert trainer.recv(timeout=0.05) is None


def test_a_closed_peer_a_foreign_line_or_an_endless_line_closes_the_channel() -> None:
    daemon, trainer = pair()
    daemon.close()
    with pytest.raises(ChannelClosed, match="closed the connection"):
        trainer.recv(timeout=1)
    with pytest.raises(ChannelClosed, match="not a message"):
        parse(b'{"op": "rm -rf"}')
    with pytest.raises(ChannelClosed, match="not JSON"):
        parse(b"\xff\xfe")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    writer = threading.Thread(target=lambda: a.sendall(b"x" * (MAX_LINE + 2)), daemon=True)
    writer.start()
    with pytest.raises(ChannelClosed, match="longer than"):
        Channel(b).recv(timeout=5)
    a.close()
    with pytest.raises(ValueError, match="over the"):
        pair()[0].send({"op": "failed", "error": "x" * MAX_LINE})


def test_only_this_users_processes_are_accepted_on_the_abstract_socket() -> None:
    name = f"coordinator-test-{secrets.token_hex(6)}"
    server = listen(name)
    try:
        mine = connect(name)
        accepted = accept(server, 5)
        assert accepted is not None
        mine.send({"op": "hello", "token": "t", "local_rank": 0})
        assert accepted.recv(timeout=5) == {"op": "hello", "token": "t", "local_rank": 0}
        if os.getuid() != 0:
            return  # only root can start a process as another user here
        # Another user on the same node connects: refused before it can say anything.
        pid = os.fork()
        if pid == 0:  # the child: become nobody, connect, linger; never return to pytest
            try:
                os.setuid(65534)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect("\0" + name)
                time.sleep(3)
            finally:
                os._exit(0)
        try:
            assert accept(server, 10) is None
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    finally:
        server.close()
