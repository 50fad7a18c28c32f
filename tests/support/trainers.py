"""The resident trainer's processes of a run on this machine, found as an operator would."""

from __future__ import annotations

import contextlib
from pathlib import Path

import psutil

from coordinator.storage.beneath import RUN_DIR_ENV


def trainer_processes(run_dir: Path, rank: int | None = None) -> list[psutil.Process]:
    """The trainer processes (`-m trainer.resident`, not their torchrun) working in
    `run_dir`; with `rank`, those of that node's torchrun (`--rdzv-conf rank=R`)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "trainer.resident" not in cmd or "torch.distributed.run" in cmd:
            continue
        with contextlib.suppress(psutil.Error):  # it exited while we looked
            if p.environ().get(RUN_DIR_ENV) != str(run_dir):
                continue
            if rank is not None and f"rank={rank}" not in " ".join(p.parent().cmdline()):
                continue
            found.append(p)
    return found
