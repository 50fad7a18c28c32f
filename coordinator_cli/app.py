"""The `coordinator` command line: run, config, status, doctor, timeline, recover, export
(and from coordinator_cli/local.py, init-model and demo).

Every value is validated here, at the boundary, with a message that names the
value, the rule and the fix; usage errors exit 2 (docs/PROTOCOL.md lists
every exit code).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from coordinator.errors import CoordinatorError, ExitCode, MalformedRecordError, UsageError
from coordinator_cli import flags as cli_flags
from coordinator_cli import local as cli_local
from coordinator_cli.args import (
    check_num_nodes,
    check_run_dir,
    existing_run_dir,
    fail_usage,
    parse_weights,
    resolve_rank,
    run_dir_arg,
    setup_logging,
)
from coordinator_cli.flags import with_config_flags
from rl import layout, node_local

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Drive a multi-node LLM RL loop through a shared filesystem.")

# Files and directories the daemons create are 0644 and 0755 whatever umask
# the job inherited (docs/PROTOCOL.md, rule 7): no group or world write.
PROTOCOL_UMASK = 0o022

def report(exc: CoordinatorError) -> typer.Exit:
    """Print an expected failure with its fix and turn it into its exit code."""
    if isinstance(exc, UsageError):
        return fail_usage(str(exc))
    if exc.exit_code is ExitCode.OK:  # nothing to do (a finished run): no error
        logging.getLogger("coordinator").info("%s", exc)
        return typer.Exit(0)
    message = str(exc)
    if isinstance(exc, MalformedRecordError):
        message += (" (this file is corrupt or was not written by coordinator: look at it, "
                    "restore or remove it, then run `coordinator recover`)")
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(int(exc.exit_code))


# The run directory: one option, one help, for every command that takes a run
# (demo makes its own, under runs/).
RunDir = Annotated[str | None, typer.Option(
    "--run-dir", "--log-path", help="The run directory on the shared filesystem (a path "
    "every node mounts), or its bucket URL (s3://, az://); --log-path is the same "
    "option, under the name the flag-file run.sh used.")]

# The options that set a config key come from coordinator_cli/flags.py (CONFIG_FLAGS);
# the others are declared here, as typer wants them.  The body validates them
# and starts the daemon.
@app.command()
@with_config_flags
def run(
    run_dir: RunDir = None,
    master: Annotated[bool, typer.Option("--master", help="This node is rank 0.")] = False,
    worker: Annotated[int | None, typer.Option(help="This node is worker rank R (1..N-1).")] = None,
    num_nodes: Annotated[int | None, typer.Option(help="Number of nodes (master; workers read it).")] = None,
    rank_weights: Annotated[str | None, typer.Option(help="Share of rollout work per node, e.g. 2,1,1, or 'auto'.")] = None,
    config: Annotated[Path | None, typer.Option(help="TOML or YAML config file.")] = None,
    node_ip: Annotated[str | None, typer.Option(help="Address of this host to serve on (master: what workers use).")] = None,
    ifname: Annotated[str | None, typer.Option(help="Interface whose IPv4 address to serve on.")] = None,
    new_run: Annotated[bool, typer.Option("--new-run", help="Archive an existing run in --run-dir and start anew.")] = False,
    set_: Annotated[list[str], typer.Option("--set", help="Any config key: section.key=value.")] = [],  # noqa: B006
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Run this node's daemon until every iteration is done (or something fails)."""
    from coordinator import routing
    from coordinator.machine import daemon_log, netaddr, refusal
    from coordinator.machine.daemon import Daemon
    from coordinator.machine.runplan import RunRequest, make_plan
    from coordinator.storage import beneath
    from coordinator.storage.storage_check import check_run_directory

    rank: int | None = None
    usable: Path | None = None  # the run directory, once proven usable
    try:
        path = run_dir_arg(run_dir)
        rank = resolve_rank(master, worker)
        check_run_dir(path)
        # Every node by itself, before anything is written: an object-store mount is
        # refused here (exit 9), not by a master's traceback workers would wait on.
        check_run_directory(path)
        beneath.confine(path)
        usable = path  # from here on a master's refusal is published there for its workers
        num_nodes = check_num_nodes(num_nodes)
        if num_nodes is not None and rank >= num_nodes:
            raise UsageError(
                f"--worker {rank} is out of range for --num-nodes {num_nodes}: workers are "
                f"1..{num_nodes - 1}")
        weights = parse_weights(rank_weights, num_nodes=num_nodes)
        if rank == 0 and weights is not None and num_nodes is None and isinstance(weights, tuple):
            num_nodes = check_num_nodes(len(weights))
        overrides = cli_flags.overrides(set_, flags or {})
        # Checked before run.json is written: a wrong address must not leave a
        # run.json behind that workers would then wait on.
        address = netaddr.choose_address(node_ip=node_ip, ifname=ifname)
        daemon_log.attach(path, rank, setup_logging(verbose, rank))  # ranks/<R>/logs/ too
        plan = make_plan(RunRequest(
            run_dir=path, rank=rank, num_nodes=num_nodes, weights=weights, config_file=config,
            overrides=overrides, new_run=new_run, address=address))
    except CoordinatorError as exc:
        if rank == 0 and usable is not None and isinstance(exc, UsageError):
            # Workers started with only --worker R --run-dir P would wait for this
            # master until their join timeout: they exit 2 with its message instead.
            refusal.refuse(usable, str(exc))
        raise report(exc) from None
    except KeyboardInterrupt:
        raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
    # This node's directory of the run (rl/node_local.py) holds the checkpoint
    # cache and is the TMPDIR of the daemon and every process it starts; the
    # last daemon of the run on the node removes it.
    checkpoint = plan.config.sections.get("checkpoint", {})
    try:
        if run_dir is not None and routing.routed(path) is not None:
            from coordinator.storage import bucket_url, objstore

            # What was fetched from the bucket goes with the run.
            node_local.hold(objstore.local_dir(bucket_url.parse(run_dir)))
        node_local.adopt(plan.manifest.run_id, str(checkpoint.get("local_cache", "")))
    except CoordinatorError as exc:
        raise report(exc) from None
    except OSError as exc:  # a full or read-only local disk
        raise report(node_local.local_disk_error(exc, Path(exc.filename or "TMPDIR"))) from None
    try:
        code = Daemon(plan).run()
    finally:
        send_logs(path, rank)
        node_local.leave_all(keep=bool(checkpoint.get("keep_local_cache", False)))
    raise typer.Exit(int(code))


def send_logs(run_dir: Path, rank: int) -> None:
    """In a bucket, this rank's processes' logs (node-local files) as objects, however
    the daemon ended: before its local root may go.  Logs what fails, never raises."""
    from coordinator import routing
    from coordinator.storage import trees

    try:
        trees.send_local_files(layout.logs(run_dir, rank), replace=True)
    except Exception as exc:
        logging.getLogger("coordinator").warning(
            "could not send rank %d's logs to %s: %s", rank, routing.display(run_dir), exc)


@app.command("config")
@with_config_flags
def show_config(
    config: Annotated[Path | None, typer.Option(help="TOML or YAML config file.")] = None,
    set_: Annotated[list[str], typer.Option("--set", help="Any config key: section.key=value.")] = [],  # noqa: B006
    flags: dict[str, Any] | None = None,
) -> None:
    """Print the resolved configuration as TOML, each value with where it came from (default,
    file, --set, a flag); exit 2 on a value refused as the configuration is read (its type,
    bounds and section checks: docs/CONFIG.md); `run` also checks it against the model, the
    data and the nodes at start."""
    from coordinator_cli import config_show

    try:
        text = config_show.show(config, set_, flags or {})
    except CoordinatorError as exc:
        raise report(exc) from None
    typer.echo(text, nl=False)


@app.command()
def status(
    run_dir: RunDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    window: Annotated[float, typer.Option(help=(
        "Seconds to watch heartbeats advance (0: one read). Shorter than the run's heartbeat "
        "interval + 1 s, a rank seen not beating is judged by its heartbeat's age against "
        "the lease, as with 0."))] = 0.0,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh until every daemon has stopped.")] = False,
    interval: Annotated[float, typer.Option(help="With --watch: seconds between refreshes.")] = 2.0,
) -> None:
    """Show every rank (host, address, iteration, phase, state, heartbeat age, what it waits
    for) and every iteration (samples trained, failed samples, reward, recoveries)."""

    from coordinator.ops import status as status_mod
    from coordinator.storage import beneath

    try:
        path = existing_run_dir(run_dir)
        if not 0 <= window <= 600:
            raise UsageError(f"--window {window:g} is outside 0..600 seconds: give e.g. 3")
        if watch and not 0.1 <= interval <= 600:
            raise UsageError(f"--interval {interval:g} is outside 0.1..600 seconds: give e.g. 2")
        if watch and as_json:
            raise UsageError("--watch and --json do not go together: poll `status --json` instead")
        beneath.confine(path)
        if watch:
            report_ = status_mod.watch(path, interval_s=interval, terminal=sys.stdout.isatty(),
                                       echo=typer.echo)
        else:
            report_ = status_mod.collect(path, window_s=window, iterations=True)
    except CoordinatorError as exc:
        raise report(exc) from None
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
    if watch:
        states = sorted({r.state.value for r in report_.ranks})
        typer.echo(f"every daemon has stopped ({', '.join(states)})")
        return
    typer.echo(status_mod.render_json(report_) if as_json else status_mod.render(report_))
    if report_.problems:
        raise typer.Exit(int(ExitCode.CORRUPT))


@app.command()
def doctor(
    run_dir: RunDir = None,
    master: Annotated[bool, typer.Option("--master", help="This node is the master (rank 0).")] = False,
    worker: Annotated[int | None, typer.Option(help="This node is worker rank R (1..N-1).")] = None,
    num_nodes: Annotated[int | None, typer.Option(help="Number of nodes (master).")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the other nodes and for each probe.")] = 60.0,
    need_gb: Annotated[float, typer.Option(help="Free space the run needs in the run directory (GiB).")] = 20.0,
    node_ip: Annotated[str | None, typer.Option(help="Master: the address workers will use.")] = None,
    ifname: Annotated[str | None, typer.Option(help="Master: interface whose IPv4 address to use.")] = None,
) -> None:
    """Prove the run directory is shared and coherent among the nodes (start it on every node)."""
    from coordinator.machine import netaddr
    from coordinator.ops.doctor import Doctor
    from coordinator.storage import beneath

    setup_logging(False)
    try:
        path = run_dir_arg(run_dir)
        rank = resolve_rank(master, worker)
        num_nodes = check_num_nodes(num_nodes)
        if rank == 0 and num_nodes is None:
            raise UsageError("the master needs --num-nodes: how many nodes take part, e.g. 3")
        if not 1 <= timeout <= 3600:
            raise UsageError(f"--timeout {timeout:g} is outside 1..3600 seconds: give e.g. 60")
        if need_gb < 0:
            raise UsageError(f"--need-gb {need_gb:g} is negative: give the GiB a run needs")
        check_run_dir(path)
        beneath.confine(path)
        address = netaddr.choose_address(node_ip=node_ip, ifname=ifname) if rank == 0 else ""
        ok = Doctor(run_dir=path, rank=rank, num_nodes=num_nodes, timeout_s=timeout,
                    need_bytes=int(need_gb * 2**30), address=address, echo=typer.echo).run()
    except CoordinatorError as exc:
        raise report(exc) from None
    if not ok:
        raise typer.Exit(int(ExitCode.PEER_LOST))


@app.command()
def timeline(
    run_dir: RunDir = None,
    out: Annotated[Path, typer.Option(help="Output file: .png or .html.")] = Path("timeline.html"),
) -> None:
    """Draw every rank's phases in every iteration (action and barrier wait), with recoveries."""
    from coordinator.ops import timeline as timeline_mod
    from coordinator.storage import beneath

    setup_logging(False)
    try:
        path = existing_run_dir(run_dir)
        if out.suffix not in timeline_mod.FORMATS:
            raise UsageError(f"--out {out}: give a file ending in "
                             f"{' or '.join(timeline_mod.FORMATS)}")
        beneath.confine(path)
        drawn = timeline_mod.load(path)
        timeline_mod.write(drawn, out)
    except CoordinatorError as exc:
        raise report(exc) from None
    iterations = len({s.iteration for s in drawn.spans})
    typer.echo(f"wrote {out}: {drawn.num_nodes} ranks, {iterations} iterations, "
               + ("recoveries unknown (recoveries.json unreadable)" if drawn.recoveries_unread
                  else f"{len(drawn.recoveries)} recoveries")
               + (f", {drawn.skipped} unreadable timing files skipped" if drawn.skipped else ""))


@app.command()
def recover(
    run_dir: RunDir = None,
    iteration: Annotated[int | None, typer.Option(help="The iteration that failed, where the restart resumes: the lowest one a journal has not completed (the default; any other is refused, naming it).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List, do not remove.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Proceed even if daemons still heartbeat.")] = False,
    window: Annotated[float | None, typer.Option(help="Seconds to watch heartbeats advance (default: heartbeat interval + 1).")] = None,
) -> None:
    """Clean up a failed iteration so that restarting every node resumes the run."""
    from coordinator.ops import recover as recover_mod
    from coordinator.storage import beneath

    setup_logging(False)
    try:
        path = existing_run_dir(run_dir)
        beneath.confine(path)
        if iteration is None:
            iteration, why = recover_mod.failed_iteration(path)
            typer.echo(f"recovering iteration {iteration}: {why} (pass --iteration N to choose)")
        plan = recover_mod.plan(path, iteration, force=force, window_s=window)
        if not dry_run:
            recover_mod.apply(plan)
    except CoordinatorError as exc:
        raise report(exc) from None
    typer.echo(recover_mod.describe(plan, dry_run=dry_run))


@app.command()
def export(
    run_dir: RunDir = None,
    out: Annotated[Path | None, typer.Option(help="Directory to write the Hugging Face model to: new or empty (see --force).")] = None,
    iteration: Annotated[int | None, typer.Option(help="Export checkpoints/iter-N (default: the newest published checkpoint).")] = None,
    best: Annotated[str | None, typer.Option(help="Export the checkpoint best by this eval metric (as checkpoint.keep_best): eval/accuracy or eval/reward_mean (higher is better), eval/num_failed (lower), NAME:max or NAME:min.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace what a non-empty --out holds.")] = False,
) -> None:
    """Write a published checkpoint as a plain Hugging Face model directory (weights as
    trained, tokenizer, chat template; no manifest) that transformers and vLLM load.
    Exit 2: a bad choice or --out; 7: the checkpoint does not match its manifest; 8: --out
    cannot be written (a full disk, no permission); 1: the checkpoint cannot be read."""
    from coordinator.storage import beneath
    from rl import export as export_mod
    from rl.keep_best import parse_metric
    from rollout.errors import CheckpointError

    setup_logging(False)
    try:
        if out is None:
            raise UsageError("--out is required: the directory to write the model to, e.g. "
                             "--out ./exported")
        metric = parse_metric(best, what="--best") if best is not None else None
        path = existing_run_dir(run_dir)
        target = export_mod.check_out(out, force=force, run_dir=path)
        beneath.confine(path)
        chosen = export_mod.choose(path, iteration=iteration, best=metric)
        done = export_mod.export(chosen, target, force=force)
    except CoordinatorError as exc:
        raise report(exc) from None
    except CheckpointError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(int(ExitCode.CORRUPT)) from None
    except OSError as exc:
        if out is not None and export_mod.writes_to(exc, out):  # a full disk, no permission
            typer.echo(f"error: cannot write --out {out}: {exc}", err=True)
            raise typer.Exit(int(ExitCode.STORAGE)) from None
        typer.echo(f"error: cannot read the checkpoint: {exc}", err=True)
        raise typer.Exit(int(ExitCode.INTERNAL)) from None
    typer.echo(done.describe())


app.command("init-model")(cli_local.init_model)
app.command()(cli_local.demo)


def main() -> None:
    os.umask(PROTOCOL_UMASK)
    app()


if __name__ == "__main__":
    main()
