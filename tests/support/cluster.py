"""Real `coordinator run` processes on this machine, for multi-rank tests.

Each rank is a subprocess (`python -m coordinator run ...`) with its own log
file; tests gate on what the ranks publish (heartbeats), kill with SIGKILL,
and always reap every process in `close()`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Short leases so that death is noticed in seconds: a heartbeat every 0.5 s,
# lost after 3 s without progress. Deadlines stay generous for a busy 2-core CI box.
TEST_CONFIG = """
[run]
actions = "scripted"
iterations = {iterations}

[coordination]
heartbeat_interval_s = 0.5
lease_s = {lease}
on_failure = "{on_failure}"
progress_interval_s = 2.0
join_timeout_s = 60.0
poll_ceiling_s = 0.5

[coordination.phase_timeouts_s]
sync = 60.0
rollout = 60.0
aggregate = 60.0
engine = 60.0
train = 60.0

[scripted]
{scripted}
"""


def write_config(path: Path, *, iterations: int = 3, lease: float = 3.0, scripted: str = "",
                 on_failure: str = "exit") -> Path:
    """A scripted run's config; on_failure "exit" unless a test is about regrouping."""
    path.write_text(TEST_CONFIG.format(iterations=iterations, lease=lease, scripted=scripted,
                                       on_failure=on_failure))
    return path


class LocalCluster:
    def __init__(self, run_dir: Path, work: Path, *, num_nodes: int, config: Path,
                 master_args: Sequence[str] = (), worker_args: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> None:
        self.run_dir = run_dir
        self.work = work
        self.num_nodes = num_nodes
        self.config = config
        self.master_args = list(master_args)
        self.worker_args = list(worker_args)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.node_env: dict[int, dict[str, str]] = {}  # one node's own, at every start
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.logs: dict[int, Path] = {}
        self.starts = 0

    def command(self, rank: int, run_dir: Path | None = None) -> list[str]:
        base = [sys.executable, "-m", "coordinator_cli", "run",
                "--run-dir", str(run_dir or self.run_dir)]
        if rank == 0:
            return [*base, "--master", "--num-nodes", str(self.num_nodes), "--config",
                    str(self.config), *self.master_args]
        return [*base, "--worker", str(rank), *self.worker_args]

    def start(self, rank: int, command: list[str] | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start one rank's daemon; `env` adds to this node's environment for this start,
        `node_env[rank]` for every start."""
        self.starts += 1
        log = self.work / f"rank{rank}-start{self.starts}.log"
        self.logs[rank] = log
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                command or self.command(rank), stdout=out, stderr=subprocess.STDOUT,
                env={**self.env, **self.node_env.get(rank, {}), **(env or {})})
        self.procs[rank] = proc
        return proc

    def start_all(self) -> None:
        for rank in range(self.num_nodes):
            self.start(rank)

    def output(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")

    def wait(self, rank: int, timeout: float) -> int:
        try:
            return self.procs[rank].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"rank {rank} did not exit within {timeout} s; its log:\n{self.output(rank)[-3000:]}"
            ) from None

    def wait_all(self, timeout: float) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        return {r: self.wait(r, max(0.1, deadline - time.monotonic())) for r in self.procs}

    def heartbeat(self, rank: int) -> dict[str, Any] | None:
        try:
            return json.loads((self.run_dir / "ranks" / str(rank) / "heartbeat.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.02)
        logs = "\n".join(f"--- rank {r}\n{self.output(r)[-1500:]}" for r in self.procs)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs}")

    def at_phase(self, rank: int, iteration: int, phase: int, state: str | None = None) -> bool:
        hb = self.heartbeat(rank)
        return bool(hb and hb["iteration"] == iteration and hb["phase"] == phase
                    and (state is None or hb["state"] == state))

    def kill(self, rank: int) -> None:
        self.procs[rank].send_signal(signal.SIGKILL)
        self.procs[rank].wait(timeout=10)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def arrivals_on_disk(run_dir: Path) -> dict[tuple[int, int, int], dict[str, Any]]:
    """Every arrival record on disk keyed by (iteration, phase, rank)."""
    out = {}
    for path in (run_dir / "iterations").glob("*/phase-*/arrive-*.json"):
        record = json.loads(path.read_text())
        out[(record["iteration"], record["phase"], record["rank"])] = record
    return out


def scripted_log(run_dir: Path, rank: int) -> list[tuple[int, int]]:
    path = run_dir / "ranks" / str(rank) / "scripted-log.json"
    return [tuple(x) for x in json.loads(path.read_text())]  # type: ignore[misc]


def scripted_runs(run_dir: Path) -> dict[tuple[int, int, int], int]:
    out = {}
    for path in (run_dir / "iterations").glob("*/scripted/rank-*/phase-*.json"):
        record = json.loads(path.read_text())
        out[(record["iteration"], record["phase"], record["rank"])] = record["runs"]
    return out
