"""A run directory in a bucket against one on a network filesystem, in the same run.

    python benchmarks/bucket_bench.py [--iterations 6] [--wait-s 30]

Both sides run 3 real `coordinator run` daemons with the scripted actions: one
side on Azurite (Microsoft's Azure Blob emulator, tests/support/buckets.py),
each rank with its own node-local root; the other on the sshfs network fixture
(tests/support/netfs.py: three mounts of one export caching like NFS clients).

1. Coordination time per iteration: all 14 phases with actions that do
   nothing, iteration 0 (the join) excluded, poll ceiling 1 s.
2. Requests per waiting rank per minute: one iteration in which the master's
   rollout sleeps --wait-s while the workers wait at the next barrier, against
   the same run without the sleep; the difference per worker, per minute of
   waiting.  On Azurite these are HTTP requests (GET, PUT, ...); on sshfs
   filesystem operations (open, read, rename, ...), counted the same way
   (coordinator/storage/fsio.py's STATS, dumped per daemon through COORDINATOR_FS_STATS).
3. What the bucket's requests would cost per 1,000 rank-hours of waiting at
   S3 Standard's list prices (PRICES).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.scripted_daemons import run_daemons, scripted_config  # noqa: E402

# USD per 1,000 requests, AWS S3 Standard list prices as the project's reference
# notes give them (../shared/ANCHORS.md, 2026-11-25; not read live from
# aws.amazon.com/s3/pricing, which this machine cannot reach): PUT, COPY, POST and
# LIST $0.005; GET and other requests $0.0004.
PRICES = {"write": 0.005, "read": 0.0004}
WRITES = frozenset({"put", "put_if_absent", "list", "copy"})
def run_ranks(where: list[str], envs: list[dict[str, str]], work: Path, *, iterations: int,
              sleep_s: float) -> dict[int, dict[str, Counter[str]]]:
    """3 daemons; each one's counts per tag (poll, heartbeat, monitor, other)."""
    work.mkdir(parents=True, exist_ok=True)
    sleeps = f'"0:0:1:{sleep_s:g}"' if sleep_s else ""
    config = scripted_config(work / "c.toml", iterations=iterations, sleeps=sleeps,
                             poll_ceiling_s=1.0)
    stats = work / "stats"
    run_daemons(where, work, config,
                envs=[{**env, "COORDINATOR_FS_STATS": str(stats)} for env in envs])
    out = {}
    for rank in range(3):
        counts = json.loads((stats / f"rank-{rank}.json").read_text())["counts"]
        out[rank] = {tag: Counter(c) for tag, c in counts.items()}
    return out


def per_iteration(read: Any, iterations: int) -> tuple[float, float]:
    totals = [json.loads(read(f"iterations/{it:06d}/timings/rank-0.json"))["total_s"]
              for it in range(1, iterations)]
    return statistics.median(totals), max(totals)


def waiting_rate(idle: dict[int, dict[str, Counter[str]]], busy: dict[int, dict[str, Counter[str]]],
                 wait_s: float) -> tuple[float, Counter[str]]:
    """Operations per worker per minute of waiting: (busy - idle) / wait."""
    diff: Counter[str] = Counter()
    for rank in (1, 2):
        for tag in busy[rank]:
            diff.update(busy[rank][tag])
            diff.subtract(idle[rank].get(tag, Counter()))
    per_minute = Counter({op: n * 60 / wait_s / 2 for op, n in diff.items() if n > 0})
    return sum(per_minute.values()), per_minute


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--wait-s", type=float, default=30.0)
    args = ap.parse_args()
    from tests.support.buckets import running
    from tests.support.netfs import NetFs

    root = Path(tempfile.mkdtemp(prefix="bucket-bench-"))
    rows: dict[str, dict[str, Any]] = {}
    try:
        with running("azurite", root / "azurite") as server:
            def bucket_side(name: str, iterations: int, sleep_s: float) -> tuple[Any, Any]:
                bucket = server.bucket(name)
                envs = [bucket.node_env(root / name, str(r)) for r in range(3)]
                counts = run_ranks([bucket.url] * 3, envs, root / name,
                                   iterations=iterations, sleep_s=sleep_s)
                return counts, lambda key: bucket.read(key) or b"{}"

            _, read = bucket_side("azurite-loop", args.iterations, 0)
            idle, _ = bucket_side("azurite-idle", 1, 0)
            busy, _ = bucket_side("azurite-wait", 1, args.wait_s)
            rows["Azurite (az://)"] = {"iteration": per_iteration(read, args.iterations),
                                       "wait": waiting_rate(idle, busy, args.wait_s)}
        with NetFs(root / "fs", mounts=3) as fs:
            def fs_side(name: str, iterations: int, sleep_s: float) -> tuple[Any, Any]:
                (fs.mounts[0] / name).mkdir()
                paths = [str(m / name) for m in fs.mounts]
                counts = run_ranks(paths, [{}, {}, {}], root / name, iterations=iterations,
                                   sleep_s=sleep_s)
                return counts, lambda key: (fs.mounts[0] / name / key).read_bytes()

            _, read = fs_side("sshfs-loop", args.iterations, 0)
            idle, _ = fs_side("sshfs-idle", 1, 0)
            busy, _ = fs_side("sshfs-wait", 1, args.wait_s)
            rows["sshfs (NFS-like)"] = {"iteration": per_iteration(read, args.iterations),
                                        "wait": waiting_rate(idle, busy, args.wait_s)}
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"3 ranks, scripted actions that do nothing, poll ceiling 1 s; coordination per "
          f"iteration over {args.iterations - 1} iterations; waiting: {args.wait_s:g} s")
    print(f"{'run directory':<18} {'s / iteration':>14} {'worst':>7} {'ops / waiting rank / min':>25}"
          f"  breakdown")
    for name, row in rows.items():
        median, worst = row["iteration"]
        total, ops = row["wait"]
        breakdown = ", ".join(f"{op} {n:.0f}" for op, n in ops.most_common())
        print(f"{name:<18} {median:>14.3f} {worst:>7.3f} {total:>25.0f}  {breakdown}")
    bucket_time = rows["Azurite (az://)"]["iteration"][0]
    fs_time = rows["sshfs (NFS-like)"]["iteration"][0]
    print(f"\nratio: bucket / sshfs coordination time per iteration {bucket_time / fs_time:.2f}x")
    _, ops = rows["Azurite (az://)"]["wait"]
    writes = sum(n for op, n in ops.items() if op in WRITES)
    reads = sum(n for op, n in ops.items() if op not in WRITES)
    per_hour = {"write": writes * 60, "read": reads * 60}
    # per_hour requests x 1,000 rank-hours, at a price per 1,000 requests.
    cost = sum(per_hour[k] * PRICES[k] for k in PRICES)
    print(f"waiting rank: {per_hour['read']:.0f} GET-class and {per_hour['write']:.0f} "
          f"PUT/LIST-class requests per hour; at S3 Standard list prices (PUT/LIST "
          f"${PRICES['write']} and GET ${PRICES['read']} per 1,000, ANCHORS.md 2026-11-25): "
          f"${cost:.2f} per 1,000 rank-hours")


if __name__ == "__main__":
    main()
