"""The bounds of the numbers and names every record carries: ranks, iterations,
phases, run ids, pids, generations.  Each check returns its value or raises
ValueError naming it and its range; records (records.py) and the run
directory's layout (layout.py) apply them before a value becomes a path.
"""

from __future__ import annotations

import re
from typing import Final

RUN_ID: Final = re.compile(r"[0-9a-f]{8,64}")
MAX_RANKS: Final = 4096
MAX_ITERATIONS: Final = 1_000_000
NUM_PHASES: Final = 14


def check_rank(rank: int, num_nodes: int = MAX_RANKS) -> int:
    if not 0 <= rank < min(num_nodes, MAX_RANKS):
        raise ValueError(f"rank {rank} is outside 0..{min(num_nodes, MAX_RANKS) - 1}")
    return rank


def check_iteration(iteration: int) -> int:
    if not 0 <= iteration < MAX_ITERATIONS:
        raise ValueError(f"iteration {iteration} is outside 0..{MAX_ITERATIONS - 1}")
    return iteration


def check_phase(phase: int) -> int:
    if not 0 <= phase < NUM_PHASES:
        raise ValueError(f"phase {phase} is outside 0..{NUM_PHASES - 1}")
    return phase


def check_run_id(run_id: str) -> str:
    # It becomes a directory name (archive/<run_id>): hex only, never a path.
    if not RUN_ID.fullmatch(run_id):
        raise ValueError(f"run_id {run_id!r} is not 8-64 lowercase hex digits")
    return run_id


def check_pid(pid: int) -> int:
    if not 0 < pid < 1 << 32:
        raise ValueError(f"pid {pid} is not a process id (1..2^32-1)")
    return pid


def check_generation(generation: int) -> int:
    if not 0 <= generation < 1 << 31:
        raise ValueError(f"generation {generation} is outside 0..2^31-1")
    return generation


def check_point(point: tuple[int, int] | None, name: str) -> None:
    """An (iteration, phase) pair such as a heartbeat's `arrived` and `released`."""
    if point is not None:
        try:
            check_iteration(point[0])
            check_phase(point[1])
        except ValueError as exc:
            raise ValueError(f"{name} {list(point)}: {exc}") from None
