"""How much memory this process may still allocate: the machine's, or less under a
cgroup limit (a Slurm job's `--mem`, a Kubernetes pod's limit).

psutil's `available` is the machine's, blind to the cgroup the process runs in: a
rank that gathered the whole model by that figure could be OOM-killed at its
job's limit with the machine half empty.  So the room is the least of

    psutil.virtual_memory().available
    for the process's memory cgroup and each of its ancestors with a limit:
        limit - usage + inactive file pages (page cache the kernel reclaims first;
        what a container runtime's "working set" leaves out too)

read from cgroup v2 (`memory.max`, `memory.current`, `memory.stat`) or v1
(`memory.limit_in_bytes`, `memory.usage_in_bytes`, `memory.stat`'s
`total_inactive_file`).  A file that cannot be read or parsed leaves that level
out: the figure is then psutil's, never a guess below it.
"""

from __future__ import annotations

from pathlib import Path

# cgroup v1 reports "no limit" as a page-aligned huge number.
_V1_UNLIMITED = 1 << 60


def available_bytes(proc: Path = Path("/proc/self/cgroup"),
                    root: Path = Path("/sys/fs/cgroup")) -> int:
    """The bytes this process may still allocate (module docstring)."""
    import psutil

    room = psutil.virtual_memory().available
    for limit in cgroup_rooms(proc, root):
        room = min(room, limit)
    return room


def cgroup_rooms(proc: Path, root: Path) -> list[int]:
    """The room left under each limited level of the process's memory cgroup."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return []
    rooms: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: the unified hierarchy
            rooms += _rooms(root, path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own
            rooms += _rooms(root / "memory", path, "memory.limit_in_bytes",
                            "memory.usage_in_bytes", "total_inactive_file")
    return rooms


def _rooms(base: Path, path: str, limit_name: str, usage_name: str, inactive: str) -> list[int]:
    out = []
    level = Path(path)
    while True:
        directory = base / str(level).lstrip("/")
        limit = _number(directory / limit_name)
        usage = _number(directory / usage_name)
        if limit is not None and usage is not None and limit < _V1_UNLIMITED:
            out.append(max(0, limit - usage + (_stat(directory / "memory.stat", inactive) or 0)))
        if level == level.parent:
            return out
        level = level.parent


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _stat(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        return None
    return None
