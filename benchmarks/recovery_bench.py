"""From a SIGKILL to resumed progress: automatic regroup against exit + recover + restart all.

    python benchmarks/recovery_bench.py              # 3 trials per mode and victim (~3 min)
    python benchmarks/recovery_bench.py --trials 1

Three `rl run --actions scripted` daemons on this machine, one run directory,
lease 5 s.  In iteration 1 the victim (a worker, then the master) sits in a
1.5 s action of phase 1 and is SIGKILLed there.  "Resumed progress" is the
moment the master publishes the release of that phase (iteration 1, phase 1):
the group has redone the interrupted work and moves on.

    wait   coordination.on_failure "wait": the killed daemon is restarted with
           its original command at once (what systemd or a requeue does);
           nobody else is touched
    exit   today's path, scripted as fast as it can go: wait until every
           survivor has exited (after the lease), run `rl recover --iteration 1`,
           restart every node

Both modes use the same lease, machine and actions in the same run; the
ratio printed is wait / exit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LEASE = 5.0
KILL_AT = (1, 1)  # iteration, phase

CONFIG = """
[run]
actions = "scripted"
iterations = 3
[scripted]
sleeps = ["{victim}:{it}:{phase}:1.5"]
[coordination]
heartbeat_interval_s = 0.5
lease_s = {lease}
on_failure = "{mode}"
poll_ceiling_s = 0.5
"""


class Group:
    def __init__(self, work: Path, config: Path) -> None:
        self.work, self.config = work, config
        self.run = work / "run"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, rank: int) -> None:
        who = ["--master", "--num-nodes", "3", "--config", str(self.config)] if rank == 0 \
            else ["--worker", str(rank)]
        with open(self.work / f"rank{rank}.log", "ab") as out:
            self.procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "coordinator_cli", "run", "--run-dir", str(self.run), *who],
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

    def heartbeat(self, rank: int) -> dict | None:
        try:
            return json.loads((self.run / f"ranks/{rank}/heartbeat.json").read_text())  # type: ignore[no-any-return]
        except (FileNotFoundError, ValueError):
            return None

    def released(self, iteration: int, phase: int) -> bool:
        path = self.run / f"iterations/{iteration:06d}/phase-{phase:02d}/release.json"
        try:
            return json.loads(path.read_text())["decision"] == "continue"
        except (FileNotFoundError, ValueError, KeyError):
            return False

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def until(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise SystemExit(f"timed out waiting for {what}")


def trial(work: Path, mode: str, victim: int) -> float:
    config = work / "c.toml"
    it, phase = KILL_AT
    config.write_text(CONFIG.format(victim=victim, it=it, phase=phase, lease=LEASE, mode=mode))
    g = Group(work, config)
    try:
        for rank in range(3):
            g.start(rank)

        def in_action() -> bool:
            hb = g.heartbeat(victim)
            return bool(hb and (hb["iteration"], hb["phase"], hb["state"]) == (it, phase,
                                                                                "running"))

        until(in_action, 120, f"rank {victim} in iteration {it} phase {phase}")
        g.procs[victim].kill()
        g.procs[victim].wait()
        killed = time.monotonic()
        if mode == "wait":
            g.start(victim)
        else:
            for rank, proc in g.procs.items():
                if rank != victim:
                    proc.wait(timeout=LEASE + 60)
            subprocess.run([sys.executable, "-m", "coordinator_cli", "recover", "--run-dir", str(g.run),
                            "--iteration", str(it)], check=True, capture_output=True, cwd=ROOT)
            for rank in range(3):
                g.start(rank)
        until(lambda: g.released(it, phase), 180, "the release of the interrupted phase")
        took = time.monotonic() - killed
        codes = [p.wait(timeout=120) for p in g.procs.values()]
        if any(codes):
            raise SystemExit(f"{mode}: daemons exited {codes}; see {work}")
        return took
    finally:
        g.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    results: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        n = 0
        for victim in (2, 0):
            for _ in range(args.trials):
                for mode in ("wait", "exit"):  # interleaved: load hits both alike
                    n += 1
                    work = Path(tmp) / f"t{n}"
                    work.mkdir()
                    took = trial(work, mode, victim)
                    results.setdefault((mode, victim), []).append(took)
                    print(f"  victim rank {victim} {mode:4s}: kill -> resumed {took:6.2f} s",
                          flush=True)
    print(f"\nlease {LEASE:g} s; median seconds from the SIGKILL to the release of the "
          "interrupted phase:")
    print(f"{'victim':10s}{'wait':>10s}{'exit+recover':>15s}{'ratio':>8s}")
    for victim, name in ((2, "worker 2"), (0, "master")):
        w = statistics.median(results[("wait", victim)])
        e = statistics.median(results[("exit", victim)])
        print(f"{name:10s}{w:9.2f}s{e:14.2f}s{w / e:8.3f}")


if __name__ == "__main__":
    main()
