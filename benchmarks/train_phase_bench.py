"""Phase 10 with the resident trainer against a trainer relaunched every iteration.

    python benchmarks/train_phase_bench.py                 # the demo, 8 iterations, both ways
    python benchmarks/train_phase_bench.py --iterations 4

Both runs are `coordinator demo` (3 nodes on this machine, the demo's
config), one after the other in this process's run: resident (the default,
`torchrun.resident = true`, `train.save_interval` 5) and relaunched
(`torchrun.resident = false`: a torchrun per iteration, which must load the
model and the saved state and save the state every iteration, as every
iteration did before the trainer stayed up).  Checkpoints are all kept
(`checkpoint.keep` 100) so their bytes can be counted.  Per iteration it
prints:

    phase 10     the slowest rank's phase-10 action (rl/training.py `train`)
    own work     the trainer's own `seconds` in metrics/train.json: from taking
                 the job (or, for a trainer started for it, from its start:
                 model, state, replay) to publishing checkpoint and metrics
    ratio        phase 10 / own work: what starting torchrun, importing torch
                 and the rendezvous add
    bytes        what the trainer wrote to the run directory: the checkpoint,
                 the training state when saved, the metrics
    iteration    the slowest rank's whole iteration (phases 0-13)

and the demo's wall time, then the ratios the issue set (phase 10 at most
1.2x the own work once the group is up; iterations at least 1.8x faster),
and after how many iterations both runs hold the same weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from coordinator.records import layout  # noqa: E402
from rl.demo import iteration_rows  # noqa: E402

NODES = 3


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def run_demo(run: Path, iterations: int, resident: bool) -> dict[str, Any]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "coordinator_cli", "demo", "--run-dir", str(run), "--nodes", str(NODES),
         "--iterations", str(iterations), "--set", f"torchrun.resident={str(resident).lower()}",
         "--set", "checkpoint.keep=100"],
        capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"the demo failed ({done.returncode}):\n{done.stdout[-3000:]}")
    rows = iteration_rows(run, iterations, NODES)
    state_sizes = [tree_bytes(d) for d in (run / "train_state").glob("iter-*")]
    state_bytes = max(state_sizes, default=0)  # older states are pruned; each is one size
    out = []
    for it in range(iterations):
        metrics = json.loads((run / f"iterations/{it:06d}/metrics/train.json").read_text())
        phase10 = max(
            json.loads((run / layout.timings(it, r)).read_text())["phases"]["10"]["action_s"]
            for r in range(NODES))
        written = tree_bytes(run / f"checkpoints/iter-{it:06d}") + \
            (run / f"iterations/{it:06d}/metrics/train.json").stat().st_size + \
            (state_bytes if metrics.get("state_saved") else 0)
        out.append({"iteration": it, "phase10_s": phase10, "own_s": metrics["seconds"],
                    "bytes": written, "iteration_s": rows[it]["total_s"],
                    "reward": rows[it]["reward_mean"], "params": metrics["params_sha256"]})
    return {"wall_s": wall, "iterations": out}


def report(name: str, result: dict[str, Any]) -> None:
    print(f"\n{name}: demo wall time {result['wall_s']:.1f} s")
    print(f"{'iter':>4} {'phase 10 s':>10} {'own s':>7} {'ratio':>6} {'MB written':>10} "
          f"{'iteration s':>11} {'reward':>7}")
    for r in result["iterations"]:
        print(f"{r['iteration']:>4} {r['phase10_s']:>10.2f} {r['own_s']:>7.2f} "
              f"{r['phase10_s'] / r['own_s']:>6.2f} {r['bytes'] / 1e6:>10.2f} "
              f"{r['iteration_s']:>11.2f} {r['reward']:>7.3f}")


def steady(result: dict[str, Any], key: str) -> float:
    """Mean over the iterations after the first (which starts engines and the group)."""
    return statistics.mean(r[key] for r in result["iterations"][1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="train-phase-bench-"))
    try:
        results = {}
        for name, resident in (("resident", True), ("relaunched", False)):
            results[name] = run_demo(work / name, args.iterations, resident)
            report(name, results[name])
        res, rel = results["resident"], results["relaunched"]
        ratios = [r["phase10_s"] / r["own_s"] for r in res["iterations"][1:]]
        print("\nsummary (iterations 1 on; iteration 0 starts the engines and the group)")
        print(f"  resident phase 10 / own work: mean {statistics.mean(ratios):.2f}, "
              f"max {max(ratios):.2f} (target <= 1.2)")
        rel_ratios = [r["phase10_s"] / r["own_s"] for r in rel["iterations"][1:]]
        print(f"  relaunched phase 10 / own work: mean {statistics.mean(rel_ratios):.2f}")
        print(f"  phase 10: {steady(rel, 'phase10_s'):.2f} s relaunched, "
              f"{steady(res, 'phase10_s'):.2f} s resident "
              f"({steady(rel, 'phase10_s') / steady(res, 'phase10_s'):.2f}x)")
        print(f"  iteration: {steady(rel, 'iteration_s'):.2f} s relaunched, "
              f"{steady(res, 'iteration_s'):.2f} s resident "
              f"({steady(rel, 'iteration_s') / steady(res, 'iteration_s'):.2f}x faster; "
              "target >= 1.8x)")
        print(f"  bytes written per iteration: {steady(rel, 'bytes') / 1e6:.2f} MB relaunched, "
              f"{steady(res, 'bytes') / 1e6:.2f} MB resident")
        print(f"  demo wall time: {rel['wall_s']:.1f} s relaunched, {res['wall_s']:.1f} s "
              f"resident ({rel['wall_s'] / res['wall_s']:.2f}x)")
        same = sum(a["params"] == b["params"] for a, b in zip(res["iterations"],
                                                              rel["iterations"], strict=True))
        print(f"  the same weights (params_sha256) as relaunched after {same} of "
              f"{args.iterations} iterations (rollouts can differ: the engine batches by timing)")
    finally:
        if args.keep:
            print(f"\nrun directories kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
