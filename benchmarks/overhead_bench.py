"""Coordination overhead per iteration: 3 ranks, all 14 phases, actions that do nothing.

    python benchmarks/overhead_bench.py             # local filesystem + sshfs network fixture
    python benchmarks/overhead_bench.py --no-netfs  # local filesystem only

Ours: 3 `coordinator run --actions scripted` daemons (no outputs), seconds
per iteration as the master measures it (iteration 0 excluded: it includes
the join).  Network fixture: the same with every rank on its own sshfs mount
of one export (tests/support/netfs.py: attribute, name and listing caches of
30 s, like NFS clients), where inotify wake-ups never cross mounts, so only
polling releases barriers.  The peer in the same run is the flag-file design
we replace (benchmarks/peer_rank.py anchor: list and count flags every 5 s),
measured per barrier and multiplied by the 14 barriers of an iteration; its
fixed sleeps (20 s after every barrier on the master, 25 + 120 s before
rollout, 10 s at the end) are left out, which flatters it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.barrier_bench import run_peer  # noqa: E402
from benchmarks.scripted_daemons import run_daemons, scripted_config  # noqa: E402


def run_ours(paths: list[Path], work: Path, iterations: int, ceiling: float) -> dict:
    config = scripted_config(work / "c.toml", iterations=iterations, poll_ceiling_s=ceiling)
    run_daemons(paths, work, config)
    totals, waits = [], []
    for it in range(1, iterations):
        t = json.loads((paths[0] / f"iterations/{it:06d}/timings/rank-0.json").read_text())
        totals.append(t["total_s"])
        for rank, path in enumerate(paths):
            tr = json.loads((path / f"iterations/{it:06d}/timings/rank-{rank}.json").read_text())
            waits.extend(v["wait_s"] for v in tr["phases"].values())
    return {"per_iteration": statistics.median(totals), "max_iteration": max(totals),
            "max_wait": max(waits), "per_barrier": statistics.median(totals) / 14}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--anchor-barriers", type=int, default=3)
    ap.add_argument("--ceiling", type=float, default=1.0, help="coordination.poll_ceiling_s")
    ap.add_argument("--no-netfs", action="store_true")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="overhead-bench-"))
    results = {}
    try:
        local = root / "local"
        local.mkdir()
        results["local"] = run_ours([local / "run"] * 3, local, args.iterations, args.ceiling)
        if not args.no_netfs:
            from tests.support.netfs import NetFs, NetFsUnavailable

            try:
                with NetFs(root / "fs", mounts=3) as fs:
                    (fs.mounts[0] / "run").mkdir()
                    work = root / "netfs"
                    work.mkdir()
                    results["sshfs"] = run_ours([m / "run" for m in fs.mounts], work,
                                                args.iterations, args.ceiling)
            except NetFsUnavailable as exc:
                print(f"network fixture skipped: {exc}")
        anchor = run_peer("anchor", 3, args.anchor_barriers, root / "anchor", trace=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    anchor_barrier = statistics.median(anchor["lat"]) if anchor["lat"] else float("nan")
    anchor_iteration = 14 * anchor_barrier
    print(f"3 ranks, 14 phases per iteration, actions that do nothing, poll ceiling "
          f"{args.ceiling:g} s")
    print(f"{'setup':<22} {'s / iteration':>14} {'worst iteration':>16} {'s / barrier':>12} "
          f"{'longest wait':>13}")
    for name, r in results.items():
        print(f"{'ours, ' + name:<22} {r['per_iteration']:>14.3f} {r['max_iteration']:>16.3f} "
              f"{r['per_barrier']:>12.4f} {r['max_wait']:>13.3f}")
    print(f"{'flag files, local':<22} {anchor_iteration:>14.1f} {'-':>16} {anchor_barrier:>12.3f} "
          f"{'-':>13}")
    print("\nratios")
    print(f"  flag files / ours per iteration, local: "
          f"{anchor_iteration / results['local']['per_iteration']:.0f}x")
    print(f"  ours local: {results['local']['per_iteration']:.3f} s per iteration (target <= 1 s)")
    if "sshfs" in results:
        r = results["sshfs"]
        print(f"  ours sshfs: longest barrier wait {r['max_wait']:.3f} s (target <= ceiling + 1 = "
              f"{args.ceiling + 1:g} s); {r['per_iteration']:.3f} s per iteration")


if __name__ == "__main__":
    main()
