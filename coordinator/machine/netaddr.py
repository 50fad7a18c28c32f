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


def host_addresses() -> dict[str, str]:
    """Every IPv4 address of this host -> the interface that carries it."""
    return {str(a.address): name for name, addrs in psutil.net_if_addrs().items()
            for a in addrs if a.family == socket.AF_INET}


def choose_address(*, node_ip: str | None = None, ifname: str | None = None) -> str:
    if node_ip is not None:
        try:
            ip = ipaddress.ip_address(node_ip)
        except ValueError:
            raise UsageError(
                f"--node-ip {node_ip!r} is not an IP address: give this node's address on the "
                "network the other nodes use, e.g. --node-ip 10.0.0.5"
            ) from None
        local = host_addresses()
        if ip.version != 4 or str(ip) not in local:
            raise UsageError(
                f"--node-ip {node_ip} is not an IPv4 address of this host (it has "
                f"{', '.join(sorted(local))}): the daemon listens on this address, so give one "
                "of these, or --ifname with the interface the other nodes reach"
            )
        return str(ip)
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


class Listener:
    """A listening TCP socket on `address`, held from the moment its port is announced.

    The training rendezvous store takes this very socket over (its descriptor
    is inherited by torchrun, see trainer/rendezvous.py), so no other process
    can take the port between its choice and its use, and the store listens
    on the discovered address only, not on every interface.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((address, 0))
        self._sock.listen(1024)
        self._sock.set_inheritable(False)
        self.port = int(self._sock.getsockname()[1])

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()


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
