"""Which address a node serves on, and whether workers can reach the master.

The master publishes the address workers and torchrun must use in its claim
(`--node-ip` wins, then `--ifname`, then the first non-loopback IPv4 address
of an interface that is up, then 127.0.0.1 for a single-machine run), plus a
probe port: a tiny TCP listener workers connect to before they register, so
that a wrong address fails at start-up with a message instead of hanging
inside torchrun an hour later.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading

import psutil

from coordinator.errors import UsageError

log = logging.getLogger(__name__)


def choose_address(*, node_ip: str | None = None, ifname: str | None = None) -> str:
    if node_ip:
        try:
            ipaddress.ip_address(node_ip)
        except ValueError:
            raise UsageError(
                f"--node-ip {node_ip!r} is not an IP address: give this node's address on the "
                "network the other nodes use, e.g. --node-ip 10.0.0.5"
            ) from None
        return node_ip
    interfaces = psutil.net_if_addrs()
    if ifname:
        if ifname not in interfaces:
            raise UsageError(
                f"--ifname {ifname!r} is not an interface of this host: known interfaces are "
                f"{', '.join(sorted(interfaces))}"
            )
        for addr in interfaces[ifname]:
            if addr.family == socket.AF_INET:
                return str(addr.address)
        raise UsageError(f"--ifname {ifname!r} has no IPv4 address: pick another interface")
    stats = psutil.net_if_stats()
    for name in sorted(interfaces):
        if name in stats and not stats[name].isup:
            continue
        for addr in interfaces[name]:
            if addr.family == socket.AF_INET and not ipaddress.ip_address(addr.address).is_loopback:
                return str(addr.address)
    return "127.0.0.1"


def free_port(address: str) -> int:
    """A TCP port free on `address` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


class ProbeServer:
    """Accepts and closes TCP connections: proof that this address is reachable."""

    def __init__(self, address: str) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        bind_to = address if address != "0.0.0.0" else ""
        self._sock.bind((bind_to, 0))
        self._sock.listen(64)
        self.port = int(self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="probe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._sock.settimeout(0.5)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()


def probe(address: str, port: int, *, timeout_s: float) -> None:
    """Connect once; raises OSError when the master is unreachable."""
    with socket.create_connection((address, port), timeout=timeout_s):
        pass
