"""torchrun's rendezvous for phase 10: the static one, on a port nobody can steal.

torchrun's built-in static rendezvous makes node rank 0's agent bind the
store port itself, on every interface, long after the master announced the
port: in between, any process on the host may take it.  Here the master's
daemon binds the port on the address it discovered when it announces it at
phase 9 (coordinator/machine/netaddr.py `Listener`) and hands the listening socket
to torchrun; this handler builds the store on that very socket
(TCPStore's `master_listen_fd`).  Workers' agents connect to the announced
address as clients; their connections wait in the socket's backlog until the
store accepts them.

torchrun finds the handler through the `torchrun.handlers` entry point
declared in pyproject.toml (torch >= 2.5):

    torchrun --rdzv-backend coordinator-static --rdzv-endpoint ADDR:PORT \\
             --rdzv-id RUN-ITER --rdzv-conf rank=R[,listen_fd=FD] --nnodes N ...

Importing this module does not import torch: the daemon only needs `BACKEND`.
"""

from __future__ import annotations

import datetime
import os
import stat
from typing import Any, Final

BACKEND: Final = "coordinator-static"
_DEFAULT_TIMEOUT_S: Final = 600


def _int(params: Any, key: str, *, minimum: int) -> int:
    raw = params.config.get(key)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"--rdzv-conf {key}={raw!r} is not an integer (the daemon sets it)") \
            from None
    if value < minimum:
        raise ValueError(f"--rdzv-conf {key}={value} is below {minimum}")
    return value


def create_handler(params: Any) -> Any:
    """torch.distributed.elastic's factory: RendezvousParameters -> RendezvousHandler."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousStoreInfo,
    )
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, -1)
    if port <= 0:
        raise ValueError(f"--rdzv-endpoint {params.endpoint!r} has no port")
    rank = _int(params, "rank", minimum=0)
    world = int(params.max_nodes)
    if rank >= world:
        raise ValueError(f"--rdzv-conf rank={rank} is outside 0..{world - 1} (--nnodes {world})")
    listen_fd = _int(params, "listen_fd", minimum=0) if rank == 0 else None
    if listen_fd is not None and not stat.S_ISSOCK(os.fstat(listen_fd).st_mode):
        raise ValueError(f"--rdzv-conf listen_fd={listen_fd} is not an inherited socket")
    timeout = datetime.timedelta(seconds=int(params.config.get("timeout", _DEFAULT_TIMEOUT_S)))

    class _Handler(RendezvousHandler):  # type: ignore[misc]
        """One fixed group per torchrun: no re-rendezvous, like the static handler."""

        def __init__(self) -> None:
            self._store: Any = None

        def get_backend(self) -> str:
            return BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True  # trainers connect to this store as clients

        def next_rendezvous(self) -> Any:
            if self._store is None:
                kwargs: dict[str, Any] = {"multi_tenant": True}
                if listen_fd is not None:
                    kwargs["master_listen_fd"] = listen_fd
                self._store = TCPStore(host, port, world, rank == 0, timeout, **kwargs)
            store = PrefixStore(params.run_id, self._store)
            return RendezvousInfo(store, rank, world, RendezvousStoreInfo(host, port))

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return str(params.run_id)

        def shutdown(self) -> bool:
            return True

    return _Handler()


def handler() -> Any:
    """The `torchrun.handlers` entry point: returns the handler factory."""
    return create_handler
