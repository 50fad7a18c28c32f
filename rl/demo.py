"""`coordinator demo`: the whole loop on simulated nodes of this machine.

Starts N `coordinator run` daemons (master + workers) as separate processes
sharing one run directory, with the tiny local model, the built-in task and the
`hf` engine; shows each node's iteration and phase live; at the end prints a
table per iteration (reward, eval accuracy, time per phase) and writes a
reward curve PNG into the run directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from coordinator.errors import UsageError
from coordinator.machine.liveness import describe_phase
from coordinator.ops.status import plain
from coordinator.records import layout
from rl import history

# The demo's settings, the same file README's Slurm try-out runs with.
DEMO_CONFIG: Final = Path(__file__).resolve().parents[1] / "examples" / "configs" / "demo.toml"


def demo_config() -> Path:
    if not DEMO_CONFIG.is_file():
        raise UsageError(f"the demo's settings file {DEMO_CONFIG} is missing: the demo runs "
                         "from a source checkout (git clone, then scripts/setup.sh)")
    return DEMO_CONFIG


def engine_settings(engine: str, *, vllm: str, nodes: int) -> list[str]:
    """The --set items that run the demo's engines: nothing for the hf engine; for
    vLLM, the executable and what the tiny model on `nodes` engines of one machine
    needs: float32 (the character model's own dtype; a bf16 model, --arch qwen2, is
    computed in it too), 128 positions, eager mode (a graph
    compile costs more than the tiny model's whole rollout), and memory shared
    among the engines: on a GPU a share of it each; on CPU, where vLLM's
    gpu_memory_utilization is a share of the node's RAM, a KV cache of 256 MiB."""
    if engine == "hf":
        return []
    if engine != "vllm":
        raise UsageError(f"--engine {engine!r} is not an engine: use hf or vllm")
    from rollout.engines.vllm_platform import probe

    platform = probe(vllm)
    extra = ["--enforce-eager"]
    items = ["engine.kind=vllm", "engine.dtype=float32", "engine.max_model_len=128",
             f"engine.vllm_executable={vllm}"]
    if platform.device == "cpu":
        extra += ["--kv-cache-memory-bytes", str(256 << 20)]
    else:
        items.append(f"engine.gpu_memory_utilization={max(0.05, 0.8 / nodes):.2f}")
    return [*items, "engine.extra_args=" + json.dumps(extra)]


def core_shares(nodes: int) -> list[list[int]]:
    """Each simulated node's share of the cores this process may use (at least one)."""
    cores = sorted(os.sched_getaffinity(0))
    return [cores[r * len(cores) // nodes:(r + 1) * len(cores) // nodes]
            or [cores[r % len(cores)]] for r in range(nodes)]


def node_environments(engine: str, *, vllm: str, nodes: int) -> list[dict[str, str]]:
    """Each node's own environment on this one machine: its share of the cores the demo
    may use.  vLLM on CPU binds its compute threads to its share
    (VLLM_CPU_OMP_THREADS_BIND; left to choose, every engine binds to the same ones);
    the hf engine (and each node's trainer) runs as many OpenMP threads as its share
    has cores (OMP_NUM_THREADS; by default each would run one per core of the machine,
    and the nodes' threads would contend for them)."""
    if engine != "vllm":
        return [{"OMP_NUM_THREADS": str(len(share))} for share in core_shares(nodes)]
    from rollout.engines.vllm_platform import probe

    if probe(vllm).device != "cpu":
        return [{} for _ in range(nodes)]
    return [{"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, share))}
            for share in core_shares(nodes)]


@dataclass(frozen=True, kw_only=True)
class DemoResult:
    codes: dict[int, int]
    rows: list[dict[str, Any]]
    png: Path | None
    seconds: float

    @property
    def ok(self) -> bool:
        return all(c == 0 for c in self.codes.values())


def iteration_rows(run_dir: Path, iterations: int, num_nodes: int) -> list[dict[str, Any]]:
    """Reward, eval accuracy, samples trained and per-phase seconds (slowest rank)
    per iteration."""
    rows = []
    for it, record in enumerate(history.records(run_dir, iterations)):
        phase_s: dict[int, float] = {}
        for rank in range(num_nodes):
            t = history.read_json(run_dir / layout.timings(it, rank)) or {}
            for phase, v in t.get("phases", {}).items():
                phase_s[int(phase)] = max(phase_s.get(int(phase), 0.0),
                                          float(v["action_s"]) + float(v["wait_s"]))
        rows.append({
            "iteration": it,
            "reward_mean": record.reward_mean,
            "eval_accuracy": record.eval_accuracy,
            "loss": record.loss,
            "samples": record.trained,
            "failed": record.failed,
            "phase_s": phase_s,
            "total_s": sum(phase_s.values()) if phase_s else None,
        })
    return rows


def improvement(rows: list[dict[str, Any]]) -> tuple[float, float] | None:
    rewards = [r["reward_mean"] for r in rows if r["reward_mean"] is not None]
    if len(rewards) < 4:
        return None
    return sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2


def render_table(rows: list[dict[str, Any]]) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="coordinator demo: per iteration")
    table.add_column("iter")
    table.add_column("reward")
    table.add_column("eval acc")
    table.add_column("loss")
    table.add_column("samples")
    table.add_column("failed")
    groups = [("rollout", (1, 2, 3)), ("aggregate", (4,)), ("eval", (5, 6)),
              ("stop", (7,)), ("train", (8, 9, 10)), ("publish", (11,)),
              ("restart", (12,)), ("sync", (0, 13))]
    for name, _ in groups:
        table.add_column(f"{name} s")
    table.add_column("total s")

    def fmt(v: Any, spec: str = ".3f") -> str:
        return "-" if v is None else format(v, spec)

    for r in rows:
        cells = [str(r["iteration"]), fmt(r["reward_mean"]), fmt(r["eval_accuracy"]),
                 fmt(r["loss"], ".4f"), fmt(r["samples"], "d"), fmt(r["failed"], "d")]
        for _, phases in groups:
            cells.append(fmt(sum(r["phase_s"].get(p, 0.0) for p in phases) if r["phase_s"]
                             else None, ".1f"))
        cells.append(fmt(r["total_s"], ".1f"))
        table.add_row(*cells)
    console = Console(width=150, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(table)
    return console.export_text()


def plot_rewards(rows: list[dict[str, Any]], out: Path) -> Path | None:
    points = [(r["iteration"], r["reward_mean"]) for r in rows if r["reward_mean"] is not None]
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label="train reward")
    evals = [(r["iteration"], r["eval_accuracy"]) for r in rows if r["eval_accuracy"] is not None]
    if evals:
        ax.plot([p[0] for p in evals], [p[1] for p in evals], marker="s", label="eval accuracy")
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean exact-match reward")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def node_line(run_dir: Path, rank: int) -> str:
    hb = history.read_json(run_dir / layout.heartbeat(rank))
    if hb is None:
        return f"node {rank}: starting"
    age = time.time() - float(hb.get("wall_time", 0))
    phase = describe_phase(int(hb.get("phase", 0)))
    text = f"node {rank}: iteration {hb.get('iteration')} {phase} {hb.get('state')} " \
           f"(heartbeat {age:.1f} s ago)"
    if hb.get("error"):
        text += f" - {hb['error'][:100]}"
    return text


# Ctrl-C: the daemons stop their engines and trainers, then exit; killed after this.
STOP_S: Final = 120.0


def stop_daemons(procs: dict[int, subprocess.Popen[bytes]], console: Any) -> None:
    """SIGTERM every daemon still running, wait STOP_S for them, saying so; a second
    Ctrl-C, or the deadline, SIGKILLs the rest (their engines die with them)."""
    running = [p for p in procs.values() if p.poll() is None]
    for p in running:
        p.send_signal(signal.SIGTERM)
    console.print(f"stopping {len(running)} daemon(s): each stops its engine and trainer "
                  f"first (at most {STOP_S:.0f} s; Ctrl-C again kills them now)")
    deadline = time.monotonic() + STOP_S
    try:
        for p in running:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        for p in running:
            if p.poll() is None:
                p.kill()


def run_demo(*, run_dir: Path, nodes: int, iterations: int, eval_interval: int,
             extra_args: list[str], node_env: list[dict[str, str]] | None = None,
             ) -> DemoResult:
    from rich.console import Console
    from rich.live import Live

    run_dir.mkdir(parents=True, exist_ok=True)
    config = demo_config()
    logs = run_dir / "demo-logs"
    logs.mkdir(exist_ok=True)
    procs: dict[int, subprocess.Popen[bytes]] = {}
    started = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    for rank in range(nodes):
        # Every daemon gets the extra settings: node-local ones (rollout.agent,
        # engine.env, ...) are read from each node's own flags, never from run.json.
        who = ["--master", "--num-nodes", str(nodes), "--config", str(config),
               "--iterations", str(iterations), "--eval-interval", str(eval_interval),
               *extra_args] if rank == 0 else ["--worker", str(rank), *extra_args]
        cmd = [sys.executable, "-m", "coordinator_cli", "run", "--run-dir", str(run_dir), *who]
        with open(logs / f"rank-{rank}.log", "wb") as out:
            own = {**env, **(node_env[rank] if node_env else {})}
            procs[rank] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=own)
    console = Console()
    try:
        with Live(console=console, refresh_per_second=2, transient=False) as live:
            while any(p.poll() is None for p in procs.values()):
                rows = iteration_rows(run_dir, iterations, nodes)
                done = [r for r in rows if r["reward_mean"] is not None]
                lines = [node_line(run_dir, r) for r in range(nodes)]
                if done:
                    lines.append(f"last train reward: {done[-1]['reward_mean']:.3f} "
                                 f"(iteration {done[-1]['iteration']})")
                lines.append(f"elapsed {time.monotonic() - started:.0f} s; logs in {logs}")
                live.update(plain("\n".join(lines)))  # heartbeat text is not markup
                time.sleep(0.5)
    except KeyboardInterrupt:
        stop_daemons(procs, console)
    codes = {r: p.wait() for r, p in procs.items()}
    rows = iteration_rows(run_dir, iterations, nodes)
    png = plot_rewards(rows, run_dir / "reward-curve.png")
    return DemoResult(codes=codes, rows=rows, png=png, seconds=time.monotonic() - started)



