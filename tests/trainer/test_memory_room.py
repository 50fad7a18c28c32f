"""trainer/memory_room.py: the room a process has under its cgroup's memory limit,
read from files laid out as cgroup v1 and v2 lay them out."""

from __future__ import annotations

from pathlib import Path

import psutil

from trainer.memory_room import available_bytes, cgroup_rooms

GIB = 1 << 30


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_counts_the_leaf_and_every_limited_ancestor_with_reclaimable_cache(
        tmp_path: Path) -> None:
    proc, root = tmp_path / "cgroup", tmp_path / "fs"
    write(proc, "0::/slurm/job_7/step_0\n")
    job, step = root / "slurm/job_7", root / "slurm/job_7/step_0"
    write(job / "memory.max", f"{64 * GIB}\n")  # the job's --mem
    write(job / "memory.current", f"{40 * GIB}\n")
    write(job / "memory.stat", f"anon {30 * GIB}\ninactive_file {6 * GIB}\n")
    write(step / "memory.max", "max\n")  # the step itself sets no limit
    write(step / "memory.current", f"{39 * GIB}\n")
    write(root / "memory.max", "garbage\n")  # unreadable levels are left out
    assert cgroup_rooms(proc, root) == [30 * GIB]  # 64 - 40 + 6
    assert available_bytes(proc, root) == min(30 * GIB, psutil.virtual_memory().available)


def test_v1_reads_the_memory_controllers_hierarchy_and_ignores_its_no_limit(
        tmp_path: Path) -> None:
    proc, root = tmp_path / "cgroup", tmp_path / "fs"
    write(proc, "12:cpu,cpuacct:/job\n5:memory:/job\n")
    job = root / "memory/job"
    write(job / "memory.limit_in_bytes", f"{8 * GIB}\n")
    write(job / "memory.usage_in_bytes", f"{5 * GIB}\n")
    write(job / "memory.stat", f"total_inactive_file {GIB}\n")
    write(root / "memory/memory.limit_in_bytes", f"{(1 << 63) - 4096}\n")  # v1's "none"
    write(root / "memory/memory.usage_in_bytes", f"{100 * GIB}\n")
    assert cgroup_rooms(proc, root) == [4 * GIB]


def test_no_cgroup_file_or_limit_leaves_the_machines_figure(tmp_path: Path) -> None:
    assert cgroup_rooms(tmp_path / "missing", tmp_path) == []
    write(tmp_path / "cgroup", "0::/\n")
    write(tmp_path / "fs/memory.max", "max\n")
    write(tmp_path / "fs/memory.current", "123\n")
    assert cgroup_rooms(tmp_path / "cgroup", tmp_path / "fs") == []
    assert available_bytes(tmp_path / "cgroup", tmp_path / "fs") > 0


def test_this_machines_figure_is_positive_and_at_most_psutils() -> None:
    assert 0 < available_bytes() <= psutil.virtual_memory().available + GIB
