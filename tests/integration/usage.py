"""The usage line as README.md writes it, run as real `coordinator run` processes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_PATH = "/tmp/rl-try"  # the --run-dir README.md's usage line uses


def usage_line(marker: str = "usage-line") -> list[list[str]]:
    """The three commands between README.md's `marker` markers (the usage line; the
    bucket's is "bucket-usage-line")."""
    text = (ROOT / "README.md").read_text()
    block = re.search(rf"<!-- {marker}:start -->\n```bash\n(.*?)```\n<!-- {marker}:end -->",
                      text, re.S)
    assert block is not None, f"README.md lost its {marker} block"
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]


def coordinator() -> str:
    """The installed console script, as a user types `coordinator`."""
    return str(Path(sys.executable).parent / "coordinator")


@dataclass
class Run:
    codes: dict[int, int]
    logs: dict[int, str]
    seconds: float


def run_nodes(commands: Sequence[Sequence[str]], *, cwd: Path, timeout_s: float,
              env: dict[str, str] | None = None,
              envs: Sequence[dict[str, str]] | None = None) -> Run:
    """Start every command at once (rank = position), wait for all, reap in any case.
    `env` adds to every node's environment, `envs[rank]` to one node's."""
    procs: dict[int, subprocess.Popen[bytes]] = {}
    outs: dict[int, Path] = {}
    started = time.monotonic()
    try:
        for rank, command in enumerate(commands):
            outs[rank] = cwd / f"node-{rank}.log"
            with outs[rank].open("wb") as out:
                procs[rank] = subprocess.Popen(
                    [coordinator(), *command[1:]], stdout=out, stderr=subprocess.STDOUT,
                    cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}),
                                   **(envs[rank] if envs else {})})
        deadline = started + timeout_s
        codes = {}
        for rank, proc in procs.items():
            try:
                codes[rank] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logs = "\n".join(f"--- node {r}\n{p.read_text(errors='replace')[-2500:]}"
                                 for r, p in outs.items())
                raise AssertionError(f"node {rank} still runs after {timeout_s} s\n{logs}") \
                    from None
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
    return Run(codes=codes, logs={r: p.read_text(errors="replace") for r, p in outs.items()},
               seconds=time.monotonic() - started)


def assert_reloaded_in_place(run: Path, ranks: int, iterations: int = 2) -> None:
    """The engines stayed up: each rank's phase-12 payload names one process,
    reloaded in place, serving what the trainer published (probes within
    tolerance)."""
    for rank in range(ranks):
        served = [json.loads((run / f"iterations/{it:06d}/phase-12/arrive-{rank}.json")
                             .read_text())["payload"] for it in range(iterations)]
        assert [s["engine"] for s in served] == ["reloaded"] * iterations, served
        assert len({s["engine_pid"] for s in served}) == 1, served
        assert all(s["probe_mean_abs_diff"] <= s["probe_tolerance"] for s in served), served
