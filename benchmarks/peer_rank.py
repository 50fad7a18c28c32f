"""One rank of a peer barrier, for benchmarks/barrier_bench.py.

    python benchmarks/peer_rank.py MODES RANK WORLD WORKDIR BARRIERS [LATE_RANK LATE_S]

MODES is a comma-separated list run one after the other in the same process
(so torch is imported once), each of:
  filestore  torch.distributed.FileStore on a file in WORKDIR: each rank adds 1
             to a counter, the last one sets a release key, all wait for it
             (FileStore polls its file every 10 ms).
  gloo       torch.distributed.barrier() over gloo with a TCP store on loopback.
  anchor     the flag-file design we replace: write <k>_rank_<r>, then list the
             directory and count flags every 5 s.

The rank waits for WORKDIR/go before its first barrier (so imports are not
measured, and strace can attach), then for each mode writes
WORKDIR/times-<mode>-<rank>.json: [[barrier, arrived_at, released_at], ...].
A LATE_RANK arrives LATE_S seconds after the others at every barrier.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ANCHOR_POLL_S = 5.0


def main() -> None:
    modes, rank, world, workdir, barriers = sys.argv[1].split(","), int(sys.argv[2]), \
        int(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])
    late_rank = int(sys.argv[6]) if len(sys.argv) > 6 else -1
    late_s = float(sys.argv[7]) if len(sys.argv) > 7 else 0.0
    if "filestore" in modes or "gloo" in modes:
        import torch.distributed  # noqa: F401  (imported before the gate, not timed)
    (workdir / f"ready-{rank}").write_text(str(os.getpid()))
    while not (workdir / "go").exists():
        time.sleep(0.01)
    for mode in modes:
        barrier = setup(mode, rank, world, workdir)
        times = []
        for k in range(barriers):
            if rank == late_rank:
                time.sleep(late_s)
            arrived = time.time()
            barrier(k)
            times.append([k, arrived, time.time()])
        (workdir / f"times-{mode}-{rank}.json").write_text(json.dumps(times))


def setup(mode: str, rank: int, world: int, workdir: Path):  # type: ignore[no-untyped-def]
    if mode == "filestore":
        import torch.distributed as dist

        store = dist.FileStore(str(workdir / "filestore"), world)

        def filestore_barrier(k: int) -> None:
            if store.add(f"arrive-{k}", 1) == world:
                store.set(f"release-{k}", b"1")
            store.wait([f"release-{k}"])

        return filestore_barrier
    if mode == "gloo":
        import torch.distributed as dist

        port = int((workdir / "port").read_text())
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)

        def gloo_barrier(k: int) -> None:
            dist.barrier()

        return gloo_barrier
    if mode == "anchor":
        flags = workdir / "flags"
        flags.mkdir(exist_ok=True)

        def anchor_barrier(k: int) -> None:
            (flags / f"{k}_rank_{rank}").write_text(str(time.time()))
            while True:
                count = sum(1 for name in os.listdir(flags) if name.startswith(f"{k}_rank_"))
                if count >= world:
                    return
                time.sleep(ANCHOR_POLL_S)

        return anchor_barrier
    raise SystemExit(f"unknown mode {mode!r}: use filestore, gloo or anchor")


if __name__ == "__main__":
    main()
