"""Phase 10's rendezvous: the port is held from its announcement until the store takes it.

Two real torchrun agents (node ranks 0 and 1 of one job, on this host) run
with the command phase 10 builds; node rank 0's store serves on the socket
the daemon bound when it announced the port, so no other process can take
the port in between, and it listens on the announced address only.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from coordinator.machine.netaddr import Listener

pytestmark = pytest.mark.slow

SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print("sum", float(t), "world", dist.get_world_size(), flush=True)
time.sleep(2.0)  # the test looks at the store's socket meanwhile
dist.destroy_process_group()
"""


def _command(tmp_path: Path, rank: int, port: int, listen_fd: int | None) -> list[str]:
    from rl.config import parse_sections
    from rl.training import torchrun_command

    cmd = torchrun_command(parse_sections({}), rank=rank, num_nodes=2, master_addr="127.0.0.1",
                           master_port=port, group="0123456789ab-3-cafe", listen_fd=listen_fd)
    assert cmd[-2:] == ["-m", "trainer.resident"]
    return [*cmd[:-2], str(tmp_path / "script.py")]


def test_the_announced_port_is_held_and_the_store_serves_on_that_socket_only(
    tmp_path: Path,
) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    listener = Listener("127.0.0.1")
    port = listener.port
    # Between the announcement (phase 9) and torchrun (phase 10) nobody can take it.
    with socket.socket() as thief, pytest.raises(OSError) as taken:
        thief.bind(("127.0.0.1", port))
    assert taken.value.errno == errno.EADDRINUSE
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    master = subprocess.Popen(_command(tmp_path, 0, port, listener.fileno()), env=env,
                              pass_fds=(listener.fileno(),), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    listener.close()  # the daemon's copy: torchrun holds the socket now
    worker = subprocess.Popen(_command(tmp_path, 1, port, None), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        listening: set[str] = set()
        deadline = time.monotonic() + 120
        while master.poll() is None and time.monotonic() < deadline:
            tree = [psutil.Process(master.pid), *psutil.Process(master.pid).children(True)]
            for proc in tree:
                try:
                    for conn in proc.net_connections(kind="tcp"):
                        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
                            listening.add(conn.laddr.ip)
                except psutil.NoSuchProcess:
                    continue
            time.sleep(0.1)
        out_master, _ = master.communicate(timeout=120)
        out_worker, _ = worker.communicate(timeout=120)
    finally:
        for p in (master, worker):
            if p.poll() is None:
                p.kill()
    assert master.returncode == 0, out_master[-3000:]
    assert worker.returncode == 0, out_worker[-3000:]
    assert "sum 3.0 world 2" in out_master
    assert listening == {"127.0.0.1"}  # the announced address, never 0.0.0.0 or ::
