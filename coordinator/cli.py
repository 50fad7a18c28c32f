"""The `coordinator` command line: run, status, recover, demo, init-model.

Every value is validated here, at the boundary, with a message that names the
value, the rule and the fix; usage errors exit 2 (docs/PROTOCOL.md lists
every exit code).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from coordinator.errors import CoordinatorError, ExitCode, UsageError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Drive a multi-node LLM RL loop through a shared filesystem.")

RANK_ENV_VARS = ("RANK", "NODE_RANK", "SLURM_PROCID")

# CLI flag -> config key.  Flags override the config file.
FLAG_KEYS = {
    "iterations": "run.iterations",
    "eval_interval": "run.eval_interval",
    "eval_before_train": "run.eval_before_train",
    "rollout_split": "run.rollout_split",
    "rl_phase": "run.rl_phase",
    "actions": "run.actions",
    "seed": "run.seed",
    "lease": "coordination.lease_s",
    "heartbeat_interval": "coordination.heartbeat_interval_s",
    "model": "model.path",
    "data_path": "data.path",
    "engine": "engine.kind",
    "local_cache": "checkpoint.local_cache",
    "keep_checkpoints": "checkpoint.keep",
}


def fail_usage(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(int(ExitCode.USAGE))


def parse_weights(text: str | None) -> tuple[float, ...] | str | None:
    if text is None:
        return None
    if text.strip() == "auto":
        return "auto"
    parts = [p.strip() for p in text.split(",")]
    weights = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise UsageError(
                f"--rank-weights {text!r}: {part!r} is not a number; give comma-separated "
                "numbers, one per node, e.g. 2,1,1, or 'auto'"
            ) from None
        if not math.isfinite(value) or value < 0:
            raise UsageError(
                f"--rank-weights {text!r}: weight {part} is negative or not finite; weights are "
                "shares of the work, so use numbers >= 0, e.g. 2,1,1"
            )
        weights.append(value)
    if sum(weights) <= 0:
        raise UsageError(
            f"--rank-weights {text!r} sum to zero: at least one node must get work, e.g. 1,1,1"
        )
    return tuple(weights)


def resolve_rank(master: bool, worker: int | None) -> int:
    if master and worker is not None:
        raise UsageError(
            f"--master and --worker {worker} both given: a daemon is either the master (rank 0) "
            "or one worker; drop one of them"
        )
    if master:
        return 0
    if worker is not None:
        if worker < 1:
            raise UsageError(
                f"--worker {worker} is below 1: workers are ranks 1..N-1 (rank 0 is --master)"
            )
        return worker
    for var in RANK_ENV_VARS:
        value = os.environ.get(var)
        if value is not None:
            try:
                rank = int(value)
            except ValueError:
                raise UsageError(f"${var}={value!r} is not an integer rank") from None
            if rank < 0:
                raise UsageError(f"${var}={rank} is negative: ranks start at 0")
            return rank
    raise UsageError(
        "no rank given: pass --master on node 0 and --worker R on the others "
        f"(or set one of ${', $'.join(RANK_ENV_VARS)})"
    )


def check_log_path(path: Path) -> Path:
    path = path.expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise UsageError(
            f"--log-path {path} is a file, not a directory: give a directory on the shared "
            "filesystem that every node mounts"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-", suffix=".tmp"):
            pass
    except OSError as exc:
        raise UsageError(
            f"--log-path {path} is not writable ({exc.strerror}): give a directory this user can "
            "write on the shared filesystem"
        ) from None
    return path


def set_dotted(target: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = target
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set {item!r} must look like section.key=value, e.g. train.lr=1e-4")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        set_dotted(out, key, value)
    return out


def setup_logging(verbose: bool, rank: int | None = None) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    who = f"rank {rank} " if rank is not None else ""
    logging.basicConfig(
        level=level, stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s",
    )
    for noisy in ("watchdog", "urllib3", "filelock", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@app.command()
def run(
    log_path: Annotated[Path | None, typer.Option(help="Run directory on the shared filesystem.")] = None,
    master: Annotated[bool, typer.Option("--master", help="This node is rank 0.")] = False,
    worker: Annotated[int | None, typer.Option(help="This node is worker rank R (1..N-1).")] = None,
    num_nodes: Annotated[int | None, typer.Option(help="Number of nodes (master; workers read it).")] = None,
    rank_weights: Annotated[str | None, typer.Option(help="Share of rollout work per node, e.g. 2,1,1, or 'auto'.")] = None,
    config: Annotated[Path | None, typer.Option(help="TOML or YAML config file.")] = None,
    iterations: Annotated[int | None, typer.Option(help="Number of RL iterations.")] = None,
    eval_interval: Annotated[int | None, typer.Option(help="Evaluate every K-th iteration (0: never).")] = None,
    eval_before_train: Annotated[bool | None, typer.Option("--eval-before-train/--no-eval-before-train", help="Evaluate the initial model in iteration 0.")] = None,
    rollout_split: Annotated[str | None, typer.Option(help="train-only, eval-only or both.")] = None,
    rl_phase: Annotated[str | None, typer.Option(help="both (phases 0-13), rollout (0-6) or update (7-13).")] = None,
    actions: Annotated[str | None, typer.Option(help="rl (default) or scripted (no ML; smoke test).")] = None,
    seed: Annotated[int | None, typer.Option(help="Run seed.")] = None,
    lease: Annotated[float | None, typer.Option(help="Seconds without heartbeat before a node is lost.")] = None,
    heartbeat_interval: Annotated[float | None, typer.Option(help="Seconds between heartbeats.")] = None,
    model: Annotated[Path | None, typer.Option(help="Hugging Face model directory (default: the tiny demo model).")] = None,
    data_path: Annotated[str | None, typer.Option(help="Task data: builtin:reverse, a parquet or JSONL file or directory.")] = None,
    engine: Annotated[str | None, typer.Option(help="Inference engine: hf or vllm.")] = None,
    local_cache: Annotated[Path | None, typer.Option(help="Node-local directory for checkpoint copies.")] = None,
    keep_checkpoints: Annotated[int | None, typer.Option(help="Published checkpoints to keep.")] = None,
    node_ip: Annotated[str | None, typer.Option(help="Address this node serves on (master: what workers use).")] = None,
    ifname: Annotated[str | None, typer.Option(help="Interface whose IPv4 address to serve on.")] = None,
    new_run: Annotated[bool, typer.Option("--new-run", help="Archive an existing run in --log-path and start anew.")] = False,
    set_: Annotated[list[str], typer.Option("--set", help="Any config key: section.key=value.")] = [],  # noqa: B006
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Run this node's daemon until every iteration is done (or something fails)."""
    from coordinator.daemon import Daemon
    from coordinator.runplan import RunRequest, make_plan

    try:
        if log_path is None:
            raise UsageError("--log-path is required: the run directory on the shared filesystem "
                             "that every node mounts, e.g. --log-path /shared/runs/exp1")
        rank = resolve_rank(master, worker)
        if num_nodes is not None and num_nodes < 1:
            raise UsageError(f"--num-nodes {num_nodes} is below 1: give the number of nodes, e.g. 3")
        if num_nodes is not None and rank >= num_nodes:
            raise UsageError(
                f"--worker {rank} is out of range for --num-nodes {num_nodes}: workers are "
                f"1..{num_nodes - 1}")
        weights = parse_weights(rank_weights)
        if weights is not None and num_nodes is not None and isinstance(weights, tuple) \
                and len(weights) != num_nodes:
            raise UsageError(
                f"--rank-weights has {len(weights)} values but --num-nodes is {num_nodes}: give "
                f"one weight per node, e.g. {','.join('1' for _ in range(num_nodes))}")
        if rank == 0 and weights is not None and num_nodes is None and isinstance(weights, tuple):
            num_nodes = len(weights)
        path = check_log_path(log_path)
        overrides = parse_set(set_)
        given = {
            "iterations": iterations, "eval_interval": eval_interval,
            "eval_before_train": eval_before_train, "rollout_split": rollout_split,
            "rl_phase": rl_phase, "actions": actions, "seed": seed, "lease": lease,
            "heartbeat_interval": heartbeat_interval, "model": model, "data_path": data_path,
            "engine": engine, "local_cache": local_cache, "keep_checkpoints": keep_checkpoints,
        }
        for flag, key in FLAG_KEYS.items():
            value = given[flag]
            if value is not None:
                set_dotted(overrides, key, str(value) if isinstance(value, Path) else value)
        setup_logging(verbose, rank)
        plan = make_plan(RunRequest(
            log_path=path, rank=rank, num_nodes=num_nodes, weights=weights, config_file=config,
            overrides=overrides, new_run=new_run, node_ip=node_ip, ifname=ifname))
    except UsageError as exc:
        raise fail_usage(str(exc)) from None
    except CoordinatorError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(int(exc.exit_code)) from None
    except KeyboardInterrupt:
        raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
    code = Daemon(plan).run()
    raise typer.Exit(int(code))


@app.command()
def status(
    log_path: Annotated[Path, typer.Option(help="Run directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    window: Annotated[float, typer.Option(help="Seconds to watch heartbeats advance (0: one read).")] = 0.0,
) -> None:
    """Show every rank: host, address, iteration, phase, state, heartbeat age, what it waits for."""
    from coordinator import status as status_mod

    if not log_path.is_dir():
        raise fail_usage(f"--log-path {log_path} is not a directory: give the run directory")
    report = status_mod.collect(log_path, window_s=window)
    typer.echo(status_mod.render_json(report) if as_json else status_mod.render(report))


@app.command()
def recover(
    log_path: Annotated[Path, typer.Option(help="Run directory.")],
    iteration: Annotated[int, typer.Option(help="The iteration that failed.")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List, do not remove.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Proceed even if daemons still heartbeat.")] = False,
    window: Annotated[float | None, typer.Option(help="Seconds to watch heartbeats (default: heartbeat interval + 1).")] = None,
) -> None:
    """Clean up a failed iteration so that restarting every node resumes the run."""
    from coordinator import recover as recover_mod
    from coordinator.records import Manifest
    from coordinator.store import FsStore, read_record

    setup_logging(False)
    try:
        if not log_path.is_dir():
            raise UsageError(f"--log-path {log_path} is not a directory: give the run directory")
        if window is None:
            manifest = read_record(FsStore(log_path), "run.json", Manifest, retry_s=2.0)
            hb = manifest.config.get("coordination", {}).get("heartbeat_interval_s", 2.0) \
                if manifest else 2.0
            window = float(hb) + 1.0
        plan = recover_mod.plan(log_path, iteration, force=force, window_s=window)
    except UsageError as exc:
        raise fail_usage(str(exc)) from None
    if not dry_run:
        recover_mod.apply(plan)
    typer.echo(recover_mod.describe(plan, dry_run=dry_run))


@app.command("init-model")
def init_model(
    out: Annotated[Path, typer.Option(help="Directory to create (must not exist).")],
    seed: Annotated[int, typer.Option(help="Weights seed.")] = 0,
    warmstart_steps: Annotated[int, typer.Option(help="Supervised warm-up steps on the built-in task (0: none).")] = 65,
) -> None:
    """Create the tiny demo model (Hugging Face format, safetensors, tokenizer) locally."""
    from trainer.launch import init_model as build

    setup_logging(False)
    if out.exists():
        raise fail_usage(f"--out {out} already exists: give a new directory")
    if warmstart_steps < 0:
        raise fail_usage(f"--warmstart-steps {warmstart_steps} is negative: use 0 to skip it")
    report = build(out, seed=seed, warmstart_steps=warmstart_steps)
    typer.echo(f"tiny model written to {out}" + (f"; warm start: {report}" if report else ""))


@app.command()
def demo(
    log_path: Annotated[Path | None, typer.Option(help="Run directory (default: runs/demo-<time>).")] = None,
    nodes: Annotated[int, typer.Option(help="Simulated nodes (daemons) on this machine.")] = 3,
    iterations: Annotated[int, typer.Option(help="RL iterations.")] = 8,
    eval_interval: Annotated[int, typer.Option(help="Evaluate every K-th iteration.")] = 2,
    extra: Annotated[list[str], typer.Option("--set", help="Extra config: section.key=value.")] = [],  # noqa: B006
) -> None:
    """Run the whole loop on simulated nodes of this machine with the tiny local model."""
    import time as _time

    from coordinator import demo as demo_mod
    from trainer.launch import init_model as build

    setup_logging(False)
    if nodes < 1:
        raise fail_usage(f"--nodes {nodes} is below 1: give the number of simulated nodes, e.g. 3")
    if iterations < 1:
        raise fail_usage(f"--iterations {iterations} is below 1")
    path = (log_path or Path("runs") / f"demo-{_time.strftime('%Y%m%d-%H%M%S')}").absolute()
    path.mkdir(parents=True, exist_ok=True)
    model = path / "model-init"
    if not (model / "manifest.json").exists():
        typer.echo(f"building the tiny model in {model} (random init + short warm start)...")
        report = build(model, seed=0, warmstart_steps=65)
        typer.echo(f"  done: {report}")
    extra_args = [a for item in extra for a in ("--set", item)]
    typer.echo(f"starting {nodes} nodes; run directory {path}")
    result = demo_mod.run_demo(log_path=path, nodes=nodes, iterations=iterations,
                               eval_interval=eval_interval, model=model, extra_args=extra_args)
    typer.echo(demo_mod.render_table(result.rows))
    gain = demo_mod.improvement(result.rows)
    if gain is not None:
        first, last = gain
        ratio = f"{last / first:.2f}x" if first > 0 else "n/a"
        typer.echo(f"mean reward: first 2 iterations {first:.3f}, last 2 {last:.3f} ({ratio})")
    if result.png:
        typer.echo(f"reward curve: {result.png}")
    typer.echo(f"{nodes} nodes, {iterations} iterations in {result.seconds:.0f} s")
    if not result.ok:
        for rank, code in sorted(result.codes.items()):
            if code != 0:
                typer.echo(f"node {rank} exited {code}; see {path}/demo-logs/rank-{rank}.log",
                           err=True)
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
