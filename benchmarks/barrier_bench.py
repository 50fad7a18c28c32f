"""Barrier release latency and filesystem load: ours against three peers, same run.

    python benchmarks/barrier_bench.py            # the full run (about 5 minutes on 2 cores)
    python benchmarks/barrier_bench.py --quick    # N = 2, 8 and a 10 s wait

Peers (benchmarks/peer_rank.py): torch.distributed.FileStore on a file in the
same directory, torch.distributed.barrier() over gloo with a TCP store on
loopback (the network reference), and the flag-file design we replace (list
the directory, count flags, every 5 s).  Ours is the real thing: N
`coordinator run --actions scripted` daemons with no work in their actions,
14 barriers per iteration.

Latency of one barrier = last release seen by any rank - last arrival.
Filesystem operations per rank per barrier: ours from the instrumented layer
(coordinator/storage/fsio.py, every call the daemon makes, heartbeats and lease
checks included); peers from `strace -c` attached to one rank.  The second
table is the long wait: N-1 ranks wait --wait-s seconds for a late rank.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.scripted_daemons import run_daemons, scripted_config  # noqa: E402

PEER = HERE / "peer_rank.py"
METADATA = {"openat", "open", "stat", "newfstatat", "statx", "fstat", "lstat", "access",
            "rename", "renameat", "renameat2", "link", "linkat", "unlink", "unlinkat", "mkdir",
            "mkdirat", "getdents64", "flock", "fcntl", "close"}
DATA = {"read", "pread64", "write", "pwrite64", "fsync", "fdatasync", "lseek"}
OUR_METADATA = {"open", "stat", "rename", "link", "unlink", "mkdir", "listdir", "rmdir",
                "fsync_dir"}

def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latencies(times: dict[int, list[list[float]]]) -> list[float]:
    """Per barrier: last release - last arrival, over ranks."""
    per: dict[int, list[tuple[float, float]]] = {}
    for rows in times.values():
        for k, arrived, released in rows:
            per.setdefault(int(k), []).append((arrived, released))
    return [max(r for _, r in v) - max(a for a, _ in v) for v in per.values()]


def _wakeups() -> bool:
    """coordination.wakeups from WAKEUPS=0/1 (default on): a TOML boolean, as the
    strict config wants it (the string "true" is refused)."""
    text = os.environ.get("WAKEUPS", "1").strip().lower()
    if text not in ("0", "1", "true", "false"):
        raise SystemExit(f"WAKEUPS={text!r}: give 1 (inotify wake-ups, the default) or 0")
    return text in ("1", "true")


def run_ours(n: int, iterations: int, work: Path, *, late_s: float = 0.0) -> dict:
    work.mkdir(parents=True)
    sleeps = f'"{n - 1}:0:1:{late_s}"' if late_s else ""
    config = scripted_config(work / "c.toml", iterations=iterations, sleeps=sleeps,
                             wakeups=_wakeups(), join_timeout_s=600.0)
    stats = work / "stats"
    run_dir = work / "run"
    run_daemons([run_dir] * n, work, config,
                envs=[{"COORDINATOR_FS_STATS": str(stats)}] * n, timeout_s=900)
    times: dict[int, list[list[float]]] = {}
    for rank in range(n):
        rows = []
        for it in range(iterations):
            t = json.loads((run_dir / f"iterations/{it:06d}/timings/rank-{rank}.json").read_text())
            for phase, v in t["phases"].items():
                rows.append([it * 14 + int(phase), v["arrived_at"], v["released_at"]])
        times[rank] = rows
    barriers = 14 * iterations
    meta = data = poll_ops = 0
    waiting = [r for r in range(n) if not (late_s and r == n - 1)]
    for rank in waiting:
        counts = json.loads((stats / f"rank-{rank}.json").read_text())["counts"]
        for tag, ops in counts.items():
            for op, k in ops.items():
                if op in OUR_METADATA:
                    meta += k
                else:
                    data += k
                if tag == "poll":
                    poll_ops += k
    per = len(waiting) * (1 if late_s else barriers)
    return {"lat": latencies(times), "meta": meta / per, "data": data / per,
            "poll": poll_ops / per}


def strace_counts(path: Path) -> tuple[int, int]:
    meta = data = 0
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[-1] in METADATA | DATA:
            try:
                calls = int(parts[3])
            except ValueError:
                continue
            if parts[-1] in METADATA:
                meta += calls
            else:
                data += calls
    return meta, data


def run_peers(modes: list[str], n: int, barriers: int, work: Path, *, late_s: float = 0.0,
              trace: str | None = None) -> dict[str, dict]:
    """Run peer barriers, one process per rank doing `modes` in turn: their latencies
    from a run with no tracer attached, then, for the mode `trace` names, its
    filesystem operations from a second run with strace on rank 0 (a traced
    process stops at every syscall, filtered or not: its latency is not the peer's).
    `filestore` counts only syscalls on the store's file (strace -P), so the gloo
    sockets of the same process do not count; `anchor` counts all."""
    results = _launch(modes, n, barriers, work / "timed", late_s=late_s, trace=None)
    if trace is not None and shutil.which("strace"):
        counted = _launch([trace], n, barriers, work / "traced", late_s=late_s, trace=trace)
        results[trace]["meta"], results[trace]["data"] = (counted[trace]["meta"],
                                                          counted[trace]["data"])
    return results


def _launch(modes: list[str], n: int, barriers: int, work: Path, *, late_s: float,
            trace: str | None) -> dict[str, dict]:
    work.mkdir(parents=True)
    if "gloo" in modes:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            (work / "port").write_text(str(s.getsockname()[1]))
    late = [str(n - 1), str(late_s)] if late_s else []
    procs = [subprocess.Popen([sys.executable, str(PEER), ",".join(modes), str(r), str(n),
                               str(work), str(barriers), *late], stdout=subprocess.DEVNULL,
                              stderr=open(work / f"rank{r}.log", "wb"))  # noqa: SIM115
             for r in range(n)]
    deadline = time.monotonic() + 600
    while not all((work / f"ready-{r}").exists() for r in range(n)):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise SystemExit(f"{modes} ranks did not get ready; see {work}")
        time.sleep(0.05)
    tracer = None
    if trace and shutil.which("strace"):
        only = ["-P", str(work / "filestore")] if trace == "filestore" else []
        tracer = subprocess.Popen(["strace", "-f", "-c", "-q", *only, "-o",
                                   str(work / "strace.txt"), "-p", str(procs[0].pid)],
                                  stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # let strace attach to every thread
    (work / "go").write_text("")
    codes = [p.wait(timeout=900) for p in procs]
    if tracer is not None:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(timeout=30)
    if any(codes):
        raise SystemExit(f"{modes} ranks failed ({codes}); see {work}")
    results = {}
    for mode in modes:
        times = {r: json.loads((work / f"times-{mode}-{r}.json").read_text()) for r in range(n)}
        result: dict = {"lat": latencies(times), "meta": None, "data": None}
        if mode == trace and tracer is not None and (work / "strace.txt").exists():
            meta, data = strace_counts(work / "strace.txt")
            per = barriers if not late_s else 1
            result["meta"], result["data"] = meta / per, data / per
        results[mode] = result
    return results


def run_peer(mode: str, n: int, barriers: int, work: Path, *, late_s: float = 0.0,
             trace: bool = True) -> dict:
    return run_peers([mode], n, barriers, work, late_s=late_s,
                     trace=mode if trace else None)[mode]


def fmt_ops(r: dict) -> str:
    if r.get("meta") is None:
        return "-"
    return f"{r['meta']:.0f} + {r['data']:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="2,8,32,64")
    ap.add_argument("--iterations", type=int, default=2, help="our iterations (14 barriers each)")
    ap.add_argument("--peer-barriers", type=int, default=10)
    ap.add_argument("--anchor-barriers", type=int, default=1)
    ap.add_argument("--wait-s", type=float, default=60.0)
    ap.add_argument("--wait-n", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="sizes 2,8 and a 10 s wait")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.wait_s = "2,8", 10.0
    sizes = [int(x) for x in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="barrier-bench-"))
    print(f"machine: {os.cpu_count()} cores; filesystem of {root}: local "
          f"({subprocess.run(['stat', '-f', '-c', '%T', str(root)], capture_output=True, text=True).stdout.strip()})")
    rows = []
    try:
        for n in sizes:
            started = time.monotonic()
            ours = run_ours(n, args.iterations if n <= 8 else 1, root / f"ours-{n}")
            peers = run_peers(["filestore", "gloo"], n, args.peer_barriers, root / f"peers-{n}",
                              trace="filestore")
            anchor = run_peer("anchor", n, args.anchor_barriers, root / f"anchor-{n}")
            rows.append((n, ours, peers["filestore"], peers["gloo"], anchor))
            print(f"N={n}: done in {time.monotonic() - started:.0f} s", flush=True)
        # The long wait: everyone but the last rank waits for it; ours and
        # FileStore wait side by side (both mostly sleep meanwhile).
        n, wait = args.wait_n, args.wait_s
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            ours_job = pool.submit(run_ours, n, 1, root / "ours-wait", late_s=wait)
            fs_job = pool.submit(run_peer, "filestore", n, 1, root / "filestore-wait",
                                 late_s=wait)
            ours_wait, fs_wait = ours_job.result(), fs_job.result()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print("\nrelease latency (ms, last arrival -> last release) and filesystem ops per rank "
          "per barrier (metadata + data)")
    head = f"{'N':>3} | {'ours p50':>8} {'p99':>7} {'ops':>9} | {'FileStore p50':>13} {'p99':>7} " \
           f"{'ops':>9} | {'gloo p50':>8} {'p99':>7} | {'anchor p50':>10} {'ops':>7}"
    print(head)
    print("-" * len(head))
    for n, ours, fs, gloo, anchor in rows:
        print(f"{n:>3} | {pct(ours['lat'], .5) * 1e3:>8.1f} {pct(ours['lat'], .99) * 1e3:>7.1f} "
              f"{fmt_ops(ours):>9} | {pct(fs['lat'], .5) * 1e3:>13.1f} "
              f"{pct(fs['lat'], .99) * 1e3:>7.1f} {fmt_ops(fs):>9} | "
              f"{pct(gloo['lat'], .5) * 1e3:>8.1f} {pct(gloo['lat'], .99) * 1e3:>7.1f} | "
              f"{pct(anchor['lat'], .5) * 1e3:>10.0f} {fmt_ops(anchor):>7}")
    n = args.wait_n
    print(f"\nlong wait: {n - 1} ranks wait {wait:.0f} s for rank {n - 1}; filesystem ops per "
          "waiting rank over the whole wait (metadata + data), release latency after it arrives")
    ours_ops = ours_wait["meta"] + ours_wait["data"]
    fs_ops = (fs_wait["meta"] or 0) + (fs_wait["data"] or 0)
    print(f"  ours:      {fmt_ops(ours_wait):>12} ops ({ours_wait['poll']:.0f} in barrier polls, "
          f"the rest heartbeats, lease checks and the daemon's own start and join), release {ours_wait['lat'][1] * 1e3:.1f} ms")
    print(f"  FileStore: {fmt_ops(fs_wait):>12} ops, release {fs_wait['lat'][0] * 1e3:.1f} ms")
    print("\nratios")
    big = rows[-1]
    print(f"  ours / FileStore filesystem ops over the {wait:.0f} s wait: "
          f"{ours_ops / fs_ops:.4f} (target <= 0.05)" if fs_ops else "  FileStore ops: n/a")
    print(f"  ours / FileStore release latency after the {wait:.0f} s wait: "
          f"{ours_wait['lat'][1] / max(fs_wait['lat'][0], 1e-9):.2f} (target <= 3)")
    print(f"  ours / FileStore release p50, back-to-back barriers at N={big[0]}: "
          f"{pct(big[1]['lat'], .5) / max(pct(big[2]['lat'], .5), 1e-9):.2f}")
    print(f"  ours release p50 / p99 at N={big[0]}: {pct(big[1]['lat'], .5) * 1e3:.1f} ms / "
          f"{pct(big[1]['lat'], .99) * 1e3:.1f} ms (targets 50 / 250 ms)")
    print(f"  anchor / ours release p50 at N={big[0]}: "
          f"{pct(big[4]['lat'], .5) / max(pct(big[1]['lat'], .5), 1e-9):.0f}x")


if __name__ == "__main__":
    main()
