"""trainer/distributed.py exit_rank: how every trainer rank ends.

A rank leaves the process group, its unflushed output still reaches the pipe,
the process returns the code it was given, and Python's interpreter shutdown
never runs (no atexit handler): that shutdown is where a gloo worker thread
freeing a finished collective aborted a rank that had done all its work
(SIGABRT, "terminate called without an active exception"; the core dump is
described in exit_rank's docstring).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RANK = r"""
import atexit, sys
import torch, torch.distributed as dist
from trainer.distributed import exit_rank

rank, init = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
left = dist.destroy_process_group

def destroy(*args, **kwargs):
    print(f"rank {rank} leaves the group", end="; ")  # unflushed, like every print below
    left(*args, **kwargs)

dist.destroy_process_group = destroy
atexit.register(lambda: print("interpreter shutdown ran", flush=True))
print(f"rank {rank} sum {float(total)}")
exit_rank(3 + rank)
"""


def test_each_rank_leaves_the_group_flushes_and_exits_with_its_code_without_shutdown(
        tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    init = f"file://{tmp_path / 'store'}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONUNBUFFERED", None)  # block-buffered, as a rank's stdout to a file is
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank), init], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    # Two interpreters importing torch on a loaded 2-core machine: 120 s is ample.
    outputs = [proc.communicate(timeout=120) for proc in ranks]
    for rank, (proc, (out, err)) in enumerate(zip(ranks, outputs, strict=True)):
        assert proc.returncode == 3 + rank, (proc.returncode, out, err[-2000:])
        assert out == f"rank {rank} sum 3.0\nrank {rank} leaves the group; ", (out, err)
        assert "interpreter shutdown ran" not in out
