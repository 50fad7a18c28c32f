"""Synchronous against asynchronous RL, disaggregated, in the same run.

    python benchmarks/async_bench.py [--iterations 8] [--rollout-s 3] [--train-s 2]
    python benchmarks/async_bench.py --real [--real-iterations 8]

1. Simulation (default): 3 real `coordinator run` daemons with the scripted
   actions and GPU-like phase durations (rl/scripted.py rollout_s,
   train_s; rollout:train 3:2), node 0 training and nodes 1-2 rolling out.
   The synchronous loop (run.max_off_policy_steps = 0) against the
   asynchronous one (k = 1), which rolls out iteration N+1 during N's phase
   10.  Printed: seconds per iteration at steady state (iteration 0, which
   has nothing rolled out ahead, excluded) and over the whole run, and the
   throughput ratio.
2. `--real`: the RL loop on the demo model (hf engine, tiny model, this
   machine's CPUs), 3 nodes, node 0 training and nodes 1-2 rolling out,
   synchronous against asynchronous: per iteration the reward, the samples'
   policy versions and staleness, the stale groups dropped, the truncated
   importance weight; and whether the async run learned (mean reward of the
   last two iterations over the first two).  On a 2-core machine the two
   sides share the cores, so its wall times say nothing about GPU speed: the
   simulation does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from benchmarks.scripted_daemons import run_daemons, scripted_config  # noqa: E402
from rollout.engines.process import python_path  # noqa: E402


def iteration_seconds(run: Path, iterations: int) -> list[float]:
    """The master's wall time of each iteration (its timings file)."""
    return [json.loads((run / f"iterations/{i:06d}/timings/rank-0.json").read_text())["total_s"]
            for i in range(iterations)]


def simulate(work: Path, *, k: int, iterations: int, rollout_s: float,
             train_s: float) -> list[float]:
    side = work / f"k{k}"
    side.mkdir(parents=True)
    config = scripted_config(side / "c.toml", iterations=iterations,
                             run={"train_nodes": "0", "max_off_policy_steps": k},
                             scripted={"rollout_s": rollout_s, "train_s": train_s},
                             poll_ceiling_s=0.2)
    run = side / "run"
    run_daemons([run] * 3, side, config)
    return iteration_seconds(run, iterations)


def simulation(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="async-bench-"))
    try:
        print(f"simulation: 3 nodes (node 0 trains, 1-2 roll out), rollout {args.rollout_s:g} s, "
              f"train {args.train_s:g} s, {args.iterations} iterations")
        sides = {k: simulate(work, k=k, iterations=args.iterations, rollout_s=args.rollout_s,
                             train_s=args.train_s) for k in (0, 1)}
        for k, seconds in sides.items():
            name = "synchronous (k=0)" if k == 0 else "asynchronous (k=1)"
            print(f"  {name:20s} per iteration {' '.join(f'{s:.2f}' for s in seconds)}; "
                  f"steady {statistics.mean(seconds[1:-1]):.2f} s, run {sum(seconds):.1f} s")
        steady = statistics.mean(sides[0][1:-1]) / statistics.mean(sides[1][1:-1])
        whole = sum(sides[0]) / sum(sides[1])
        print(f"iteration throughput, async / sync: {steady:.2f}x at steady state, "
              f"{whole:.2f}x over the whole run (ideal steady "
              f"{(args.rollout_s + args.train_s) / max(args.rollout_s, args.train_s):.2f}x)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def real_loop(work: Path, *, k: int, iterations: int) -> tuple[list[dict], float]:
    run = work / f"real-k{k}"
    sets = [a for s in ("run.train_nodes=0", f"run.max_off_policy_steps={k}",
                        "schedule.eval_interval=0") for a in ("--set", s)]
    commands = [["--master", "--num-nodes", "3", "--iterations", str(iterations), *sets],
                ["--worker", "1"], ["--worker", "2"]]
    started = time.monotonic()
    procs = []
    for rank, extra in enumerate(commands):
        with open(work / f"real-k{k}-rank{rank}.log", "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "coordinator_cli", "run", "--run-dir", str(run), *extra],
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                env={**os.environ,
                     "PYTHONPATH": python_path(str(ROOT), os.environ.get("PYTHONPATH"))}))
    codes = [p.wait(timeout=3600) for p in procs]
    wall = time.monotonic() - started
    if any(codes):
        raise SystemExit(f"the k={k} run failed {codes}; see {work}")
    rows = []
    for i in range(iterations):
        metrics = run / f"iterations/{i:06d}/metrics"
        rollout = json.loads((metrics / "rollout.json").read_text())
        train = json.loads((metrics / "train.json").read_text())
        rows.append({"reward": rollout["reward_mean"], "versions": rollout["policy_versions"],
                     "staleness": rollout["staleness_max"],
                     "dropped": rollout["stale_groups_dropped"],
                     "tis": train.get("tis_weight_mean"),
                     "mismatch": train["logprob_mismatch_mean_abs"]})
    return rows, wall


def real(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="async-bench-real-"))
    try:
        n = args.real_iterations
        print(f"real loop: demo model, 3 nodes (node 0 trains, 1-2 roll out), {n} iterations")
        for k in (0, 1):
            rows, wall = real_loop(work, k=k, iterations=n)
            print(f"  k={k}: {wall:.0f} s")
            for i, r in enumerate(rows):
                tis = f"{r['tis']:.3f}" if r["tis"] is not None else "-"
                print(f"    iteration {i}: reward {r['reward']:.3f}  versions {r['versions']}  "
                      f"staleness {r['staleness']}  dropped {r['dropped']}  tis {tis}  "
                      f"mismatch {r['mismatch']:.4f}")
            first = statistics.mean(r["reward"] for r in rows[:2])
            last = statistics.mean(r["reward"] for r in rows[-2:])
            within = all(r["staleness"] <= k for r in rows)
            print(f"    last two / first two reward: {last:.3f} / {first:.3f} = "
                  f"{last / first:.2f}x; every batch within k={k}: {within}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--rollout-s", type=float, default=3.0)
    parser.add_argument("--train-s", type=float, default=2.0)
    parser.add_argument("--real", action="store_true", help="the RL loop on the demo model")
    parser.add_argument("--real-iterations", type=int, default=8)
    args = parser.parse_args()
    real(args) if args.real else simulation(args)


if __name__ == "__main__":
    main()
