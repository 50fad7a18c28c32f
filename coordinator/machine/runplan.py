"""From a validated command line to a `RunPlan`: which run, which config.

The master resolves the run: a run directory without `run.json` starts a new
run; an existing run with the same experiment (config hash, node count,
weights) is resumed; anything else is refused unless `--new-run` archives the
old run first.  A worker waits for the master, then takes node count,
weights and config from the manifest and checks that whatever it was also
given on its own command line agrees.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coordinator import routing
from coordinator.config.run_config import (
    OPERATIONAL_KEYS,
    CoordinationConfig,
    RunConfig,
    deep_merge,
    drop_keys,
    from_mapping,
    is_under,
    load_file,
    pick_keys,
)
from coordinator.errors import RunCompleted, UsageError
from coordinator.machine import finished, membership, refusal, regroup
from coordinator.machine.actions import (
    completed_run,
    kind,
    kind_of,
    node_local_keys,
    resolve_config,
)
from coordinator.machine.polling import Backoff
from coordinator.ops.status import BEAT_SLACK_S, collect
from coordinator.records import layout
from coordinator.records.records import Manifest, Weights
from coordinator.storage import fsio
from coordinator.storage.store import FsStore, read_record

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunPlan:
    """What this daemon was asked to do, after CLI validation and run resolution."""

    run_dir: Path
    rank: int
    manifest: Manifest
    config: RunConfig
    address: str = "127.0.0.1"  # this host's address, checked at the CLI boundary
    # Workers: the live master found before the plan was made.
    master: membership.MasterInfo | None = None
    # Master: run.json to republish once rank 0 is held (operational keys changed).
    republish: Manifest | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunRequest:
    run_dir: Path
    rank: int
    num_nodes: int | None
    weights: Weights | None
    config_file: Path | None
    overrides: Mapping[str, Any]
    new_run: bool = False
    address: str = "127.0.0.1"  # this host's, checked by the CLI before anything is written


def _raw_config(req: RunRequest) -> dict[str, Any]:
    raw = load_file(req.config_file) if req.config_file else {}
    return deep_merge(raw, req.overrides)


def make_plan(req: RunRequest) -> RunPlan:
    if req.rank != 0:
        return _plan_worker(req)
    plan = _plan_master(req)
    # Accepted: a refusal of an earlier start no longer stands (coordinator/machine/refusal.py;
    # a refused master publishes one from coordinator_cli/app.py).
    refusal.clear(FsStore(req.run_dir), req.run_dir)
    return plan


def _plan_master(req: RunRequest) -> RunPlan:
    config = resolve_config(_raw_config(req))
    _check_bucket(req.run_dir, config)
    num_nodes = req.num_nodes or 1
    # The CLI checked the weights against the node count (coordinator_cli/args.py).
    weights = req.weights if req.weights is not None else tuple(1.0 for _ in range(num_nodes))
    check_run = kind(config.run.actions).check_run
    if check_run is not None:
        check_run(config, num_nodes, weights)  # UsageError before anything is written
    if config.coordination.min_nodes > num_nodes:
        raise UsageError(
            f"coordination.min_nodes={config.coordination.min_nodes} is above --num-nodes "
            f"{num_nodes}: a shrunk group could never go on; give at most {num_nodes}")
    store = FsStore(req.run_dir)
    existing = read_record(store, layout.MANIFEST, Manifest, retry_s=2.0)
    if existing is not None and req.new_run:
        _archive(req.run_dir, existing, config)
        existing = None
    republish = None
    if existing is None:
        fresh = Manifest(
            run_id=secrets.token_hex(6), generation=0, num_nodes=num_nodes, weights=weights,
            config=config.experiment(), config_hash=config.hash(), created=time.time(),
        )
        # Created exclusively, like a rank claim: of two masters started at
        # once on a fresh directory, one creates the run and the other finds
        # it and resumes it, and the rank-0 claim then lets only one of them run.
        if store.create_exclusive(layout.MANIFEST, fresh.to_bytes()):
            log.info("new run %s in %s: %d node(s), weights %s", fresh.run_id, routing.display(req.run_dir),
                     num_nodes, weights)
            return RunPlan(run_dir=req.run_dir, rank=0, manifest=fresh, config=config,
                           address=req.address)
        existing = read_record(store, layout.MANIFEST, Manifest, retry_s=2.0)
        if existing is None:
            raise UsageError(
                f"{routing.display(req.run_dir)}/run.json appeared and vanished while this master started: is "
                "another master starting or archiving in the same --run-dir? Stop it first")
        log.info("another master created run %s in %s a moment ago: joining it",
                 existing.run_id, routing.display(req.run_dir))
    manifest, republish = _resume(existing, config, num_nodes, weights, req)
    return RunPlan(run_dir=req.run_dir, rank=0, manifest=manifest, config=config,
                   address=req.address, republish=republish)


def _differences(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.extend(_differences(a, b, f"{prefix}{key}."))
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def _resume(existing: Manifest, config: RunConfig, num_nodes: int,
            weights: Weights, req: RunRequest) -> tuple[Manifest, Manifest | None]:
    """The run to resume, and the run.json to republish once rank 0 is ours (or None)."""
    changes = []
    if existing.num_nodes != num_nodes:
        changes.append(f"num_nodes: {existing.num_nodes} -> {num_nodes}")
    if tuple(existing.weights) != tuple(weights) if not isinstance(weights, str) else \
            existing.weights != weights:
        changes.append(f"weights: {existing.weights} -> {weights}")
    recorded = drop_keys(existing.config, config.node_local)
    experiment = config.experiment()
    if existing.config_hash != config.hash():
        changes.extend(d for d in _differences(recorded, experiment)
                       if not is_under(d.split(":", 1)[0], OPERATIONAL_KEYS))
    if changes:
        raise UsageError(
            f"{routing.display(req.run_dir)} holds run {existing.run_id} with a different setup "
            f"({'; '.join(changes[:5])}): restart with the original flags and config to resume "
            "it, pass --new-run to archive it and start a new run, or use another --run-dir"
        )
    log.info("resuming run %s generation %d in %s", existing.run_id, existing.generation,
             routing.display(req.run_dir))
    if existing.config != experiment:  # only operational keys differ
        updated = dataclasses.replace(existing, config=experiment)
        return updated, updated
    return existing, None


def _archive(run_dir: Path, old: Manifest, config: RunConfig) -> None:
    report = collect(run_dir, window_s=config.coordination.heartbeat_interval_s + BEAT_SLACK_S)
    live = report.live()
    if live:
        who = ", ".join(f"rank {r.rank} (pid {r.pid} on {r.host})" for r in live)
        raise UsageError(
            f"--new-run would archive run {old.run_id}, but its daemons still heartbeat: {who}; "
            "stop them first"
        )
    # The run id was checked as hex when run.json was parsed: this stays a
    # child of archive/, and every move below is resolved beneath the run
    # directory without following a symlink.
    target = run_dir / layout.ARCHIVE / old.run_id
    # run.json last: a --new-run broken off midway finds the old run still there
    # and archives the rest when started again.
    for name in (layout.SESSION, layout.RANKS, layout.ITERATIONS, layout.CHECKPOINTS,
                 layout.RECOVERIES, *kind(config.run.actions).run_outputs, layout.MANIFEST):
        try:
            fsio.rename(run_dir / name, target / name)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise UsageError(
                f"--new-run could not move {run_dir / name} to {target / name} "
                f"({exc.strerror}): move or remove it by hand, then start again") from None
    log.info("archived run %s to %s", old.run_id, target)


def _judge_completed(store: FsStore, req: RunRequest, *, retry_s: float) -> None:
    """A worker started on a run already complete exits as the daemons that ran it
    did: 0 with what the run did, or 4 (PhaseFailedError) when it did not learn."""
    manifest = read_record(store, layout.MANIFEST, Manifest, retry_s=retry_s)
    if manifest is None:  # archived meanwhile: nothing left to judge
        return
    action_kind = kind_of(manifest.config)
    config = RunConfig.from_dict(manifest.config, action_kind.run_section)
    recoveries = len(regroup.read_log(store, manifest.run_id, retry_s=retry_s).recoveries)
    summary = completed_run(action_kind, req.run_dir, config, run_id=manifest.run_id,
                            recoveries=recoveries,
                            last_phase=action_kind.phases_of(config)[-1])
    log.info("rank %d: the run finished %s", req.rank, summary)


def _check_bucket(run_dir: Path, config: RunConfig) -> None:
    """Refuse, before anything is written, actions that cannot run in a bucket."""
    action_kind = kind(config.run.actions)
    if routing.routed(run_dir) is not None and not action_kind.runs_on_buckets:
        raise UsageError(
            f"run.actions={action_kind.name!r} cannot run in a bucket run directory "
            f"({routing.display(run_dir)}): the package that registers it does not declare "
            "that every file its actions write goes through coordinator/fsio "
            "(ActionKind.runs_on_buckets); give --run-dir a directory on a shared POSIX "
            "filesystem (NFS, Lustre, GPFS)")


def _plan_worker(req: RunRequest) -> RunPlan:
    raw = _raw_config(req)
    # What this worker was given, checked as the master checks its own before the
    # wait: a mistyped key or a bad value exits 2 now, not once the master is up.
    # A bare worker (--worker R --run-dir P) has nothing to check, and resolving
    # would import the default action kind's package (seconds: torch) for nothing.
    if raw:
        resolve_config(raw)
    local = from_mapping(CoordinationConfig, raw.get("coordination", {}), "coordination")
    store = FsStore(req.run_dir)
    # A master that refused its settings will not come: exit 2 with its message.
    refused = refusal.watch_worker(store)
    # A finished run's master may never come: exit 0 (RunCompleted) instead.
    done = finished.watch_worker(store, rank=req.rank, retry_s=local.read_retry_s)

    def check() -> None:
        refused.check()
        done()

    try:
        info = membership.wait_for_master(
            store, run_dir=routing.display(req.run_dir), join_timeout_s=local.join_timeout_s,
            backoff=Backoff(initial_s=local.poll_initial_s, factor=local.poll_factor,
                            ceiling_s=local.poll_ceiling_s),
            progress_interval_s=local.progress_interval_s, retry_s=local.read_retry_s,
            probe_timeout_s=local.probe_timeout_s, check=check, note=refused.note,
        )
    except RunCompleted:
        _judge_completed(store, req, retry_s=local.read_retry_s)
        raise
    manifest = info.manifest
    if req.rank >= manifest.num_nodes:
        raise UsageError(
            f"--worker {req.rank} is out of range: run {manifest.run_id} has "
            f"{manifest.num_nodes} node(s), so workers are 1..{manifest.num_nodes - 1}"
        )
    if req.num_nodes is not None and req.num_nodes != manifest.num_nodes:
        raise UsageError(
            f"--num-nodes {req.num_nodes} disagrees with the master's {manifest.num_nodes}: "
            "drop the flag on workers (they read it from run.json) or fix it on the master"
        )
    if req.weights is not None and req.weights != manifest.weights:
        raise UsageError(
            f"--rank-weights {req.weights} disagrees with the master's {manifest.weights}: "
            "drop the flag on workers or fix it on the master"
        )
    config = node_config(manifest.config, raw)
    _check_bucket(req.run_dir, config)
    local_keys = config.node_local
    resolved = config.to_dict()
    diffs = []
    for key, value in _flatten(raw):
        if is_under(key, local_keys):
            continue
        node: Any = resolved
        for part in key.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        given = list(value) if isinstance(value, tuple) else value
        if node != given and not (isinstance(node, float) and given == node):
            diffs.append(f"{key}: master {node!r}, this worker {value!r}")
    if diffs:
        raise UsageError(
            f"this worker's settings disagree with the master's ({'; '.join(diffs[:5])}): "
            "workers need only --worker R --run-dir P; drop the extra settings or make them "
            "match the master's"
        )
    return RunPlan(run_dir=req.run_dir, rank=req.rank, manifest=manifest, config=config,
                   address=req.address, master=info)


def node_config(experiment: Mapping[str, Any], raw: Mapping[str, Any]) -> RunConfig:
    """This node's configuration: the run's experiment from run.json, and the
    node-local keys from this node's own config and flags only.  run.json
    never decides what a node executes, with which environment or secrets."""
    local_keys = node_local_keys(experiment)
    return resolve_config(deep_merge(drop_keys(experiment, local_keys),
                                     pick_keys(raw, local_keys)))


def _flatten(raw: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in raw.items():
        if isinstance(value, Mapping):
            out.extend(_flatten(value, f"{prefix}{key}."))
        else:
            out.append((f"{prefix}{key}", value))
    return out
