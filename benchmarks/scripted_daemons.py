"""Real `coordinator run` daemons with the scripted actions, for the benchmarks.

`scripted_config` writes the run's TOML (actions that write nothing, optional
sleeps, coordination settings); `run_daemons` starts one daemon per run
directory path (rank = position, the master first), each with its own stderr log
and extra environment, waits for all, and stops the benchmark when one fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _toml(keys: Mapping[str, Any]) -> str:
    """Booleans, numbers and strings as TOML writes them, one key per line."""
    def value(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) \
            else str(v)
    return "".join(f"{k} = {value(v)}\n" for k, v in keys.items())


def scripted_config(path: Path, *, iterations: int, sleeps: str = "",
                    run: Mapping[str, Any] | None = None,
                    scripted: Mapping[str, Any] | None = None, **coordination: Any) -> Path:
    """The run's config at `path`: `sleeps` as scripted.sleeps items ('"0:0:1:30"');
    `run` and `scripted` as more keys of those sections, `coordination` as
    [coordination] keys."""
    path.write_text(f'[run]\nactions = "scripted"\niterations = {iterations}\n'
                    f"{_toml(run or {})}"
                    f"[scripted]\noutputs = false\nsleeps = [{sleeps}]\n{_toml(scripted or {})}"
                    f"[coordination]\n{_toml(coordination)}")
    return path


def run_daemons(where: Sequence[str | Path], work: Path, config: Path, *,
                envs: Sequence[Mapping[str, str]] | None = None,
                timeout_s: float = 600) -> None:
    """One daemon per entry of `where` (its --run-dir); SystemExit if any fails."""
    procs = []
    for rank, path in enumerate(where):
        who = ["--master", "--num-nodes", str(len(where)), "--config", str(config)] \
            if rank == 0 else ["--worker", str(rank)]
        with open(work / f"rank{rank}.log", "wb") as err:  # the child keeps its own copy
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "coordinator_cli", "run", "--run-dir", str(path), *who],
                stdout=subprocess.DEVNULL, stderr=err,
                env={**os.environ, **(envs[rank] if envs else {})}))
    codes = [p.wait(timeout=timeout_s) for p in procs]
    if any(codes):
        raise SystemExit(f"daemons failed {codes}; see {work}")
