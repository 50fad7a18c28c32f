"""`coordinator recover`: clean up after a crash so that a restart resumes.

Recovery never guesses from mtimes. It refuses while any rank's heartbeat
still advances (unless --force), removes the records of the failed attempt
(arrival and release records of iterations >= N, temporary files, claims,
partial outputs of actions that the journals do not mark complete), keeps
every completed output, and bumps the generation so that a daemon from before
that wakes up late is ignored and stops itself.

It keeps session.json: its members are the ranks the group had gone on with
(on_failure "shrink"), so that the restarted group starts where recover says
(regroup.start_iteration) instead of going back with a rank left out into
iterations completed without it, whose checkpoints may be pruned.  A stale
session is harmless: a worker joins only a session naming its new token, and
the old session's arrivals and releases are removed or ignored by its id.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path

from coordinator import routing
from coordinator.config.run_config import RunConfig
from coordinator.errors import UsageError
from coordinator.machine.actions import kind, resolve_config
from coordinator.ops.status import BEAT_SLACK_S, collect
from coordinator.records import layout
from coordinator.records.bounds import MAX_ITERATIONS
from coordinator.records.phases import Phase
from coordinator.records.records import Heartbeat, Journal, Manifest, Session
from coordinator.storage import fsio
from coordinator.storage.store import FsStore, publish_record, read_record

log = logging.getLogger(__name__)
_RECORD = re.compile(r"^(arrive-\d+|release)\.json$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecoveryPlan:
    run_dir: Path
    iteration: int
    generation: int
    remove: tuple[Path, ...]
    kept_outputs: int
    live: tuple[str, ...]


def _furthest_iteration(store: FsStore, manifest: Manifest, limit: int) -> int:
    """The furthest iteration any record of this run reached, never beyond `limit`.

    Heartbeats and journals are parsed strictly (an iteration out of range
    makes them malformed, named by path); `limit`, the run's configured
    iteration count, bounds every loop over iterations that follows.
    """
    furthest = -1
    for rank in range(manifest.num_nodes):
        journal = read_record(store, layout.journal(rank), Journal, retry_s=1.0)
        if journal is not None and journal.run_id == manifest.run_id:
            furthest = max(furthest, journal.iteration, journal.completed_iteration + 1)
        hb = read_record(store, layout.heartbeat(rank), Heartbeat, retry_s=1.0)
        if hb is not None and hb.run_id == manifest.run_id:
            furthest = max(furthest, hb.iteration)
    for name in store.listdir(layout.ITERATIONS):
        if (found := layout.iteration_named(name)) is not None:
            furthest = max(furthest, found)
    return min(furthest, limit)


def failed_iteration(run_dir: Path) -> tuple[int, str]:
    """The iteration to recover, from the journals, and why: the lowest one a rank
    has not completed (ranks of the last session only, when the group had gone on
    without some: coordination.on_failure "shrink"), where a restart resumes."""
    store = FsStore(run_dir)
    return _resume_point(store, run_dir, _manifest(store, run_dir))


def _manifest(store: FsStore, run_dir: Path) -> Manifest:
    manifest = read_record(store, layout.MANIFEST, Manifest, retry_s=2.0)
    if manifest is None:
        raise UsageError(f"--run-dir {routing.display(run_dir)} holds no run (no run.json): nothing to recover")
    return manifest


def _resume_point(store: FsStore, run_dir: Path, manifest: Manifest) -> tuple[int, str]:
    iterations = resolve_config(manifest.config).run.iterations
    session = read_record(store, layout.SESSION, Session, retry_s=2.0)
    ranks = [r for r in range(manifest.num_nodes)
             if session is None or session.run_id != manifest.run_id
             or session.token_of(r) is not None]
    resume: dict[int, int] = {}
    for rank in ranks:
        journal = read_record(store, layout.journal(rank), Journal, retry_s=1.0)
        ok = journal is not None and journal.run_id == manifest.run_id
        resume[rank] = journal.resume_iteration if journal is not None and ok else 0
    lowest = min(resume.values())
    if lowest >= iterations:
        raise UsageError(f"run {manifest.run_id} is complete (every journal completed its "
                         f"{iterations} iterations): nothing to recover")
    behind = [r for r, it in sorted(resume.items()) if it == lowest]
    return lowest, (f"the lowest iteration a journal has not completed: rank(s) {behind} "
                    f"stopped in iteration {lowest}")


def plan(run_dir: Path, iteration: int, *, force: bool, window_s: float | None) -> RecoveryPlan:
    """What recovering `iteration` removes and keeps; raises before anything is removed."""
    if not 0 <= iteration < MAX_ITERATIONS:
        raise UsageError(
            f"--iteration {iteration} is outside 0..{MAX_ITERATIONS - 1}: give the iteration "
            "that failed, as shown by `coordinator status` (0 is the first)"
        )
    store = FsStore(run_dir)
    manifest = _manifest(store, run_dir)
    config = resolve_config(manifest.config)
    furthest = _furthest_iteration(store, manifest, config.run.iterations)
    # A restart resumes where the journals say, whatever was cleaned: recovering
    # any other iteration would leave that one's unfinished outputs in place (a
    # later one) or remove records of iterations every rank completed (an earlier).
    resume, why = _resume_point(store, run_dir, manifest)
    if iteration != resume:
        raise UsageError(
            f"--iteration {iteration} is not where run {manifest.run_id} resumes: {why}, and "
            f"a restart resumes there; give --iteration {resume}, or leave it out")
    live = _live_daemons(run_dir, config.coordination.heartbeat_interval_s + BEAT_SLACK_S
                         if window_s is None else window_s)
    if live and not force:
        raise UsageError(
            f"refusing to recover while daemons still heartbeat: {', '.join(live)}; stop them "
            "first (they exit by themselves within the lease once a peer is lost), or pass "
            "--force to fence them off"
        )
    remove = _protocol_records(store, run_dir, iteration, manifest.num_nodes)
    outputs, kept = _unfinished_outputs(store, run_dir, config, manifest, iteration,
                                        max(furthest, iteration))
    return RecoveryPlan(run_dir=run_dir, iteration=iteration,
                        generation=manifest.generation + 1,
                        remove=tuple(dict.fromkeys(remove + outputs)), kept_outputs=kept,
                        live=live)


def _live_daemons(run_dir: Path, window_s: float) -> tuple[str, ...]:
    """Ranks whose heartbeat counter advanced over `window_s` on this host's clock."""
    if not 0 < window_s <= 600:
        # Liveness is only ever judged from heartbeat counters seen advancing
        # on this host's clock; without a window there is nothing to see, and
        # comparing wall clocks across hosts is exactly what must not decide.
        raise UsageError(
            f"--window {window_s:g} must be above 0 (and at most 600) seconds: recover watches "
            "every heartbeat for that long to see which daemons still run, e.g. --window 3")
    report = collect(run_dir, window_s=window_s)
    if report.problems:
        raise report.problems[0]
    return tuple(f"rank {r.rank} (pid {r.pid} on {r.host}, {r.state.value})"
                 for r in report.live())


def _protocol_records(store: FsStore, root: Path, iteration: int,
                      num_nodes: int) -> list[Path]:
    """Arrivals and releases from `iteration` on, claims, temporary files."""
    remove: list[Path] = []
    for name in store.listdir(layout.ITERATIONS):
        found = layout.iteration_named(name)
        if found is None or found < iteration:
            continue
        it_dir = root / layout.ITERATIONS / name
        for phase_name in store.listdir(f"{layout.ITERATIONS}/{name}"):
            if not phase_name.startswith("phase-"):
                continue
            for record in store.listdir(f"{layout.ITERATIONS}/{name}/{phase_name}"):
                if _RECORD.match(record):
                    remove.append(it_dir / phase_name / record)
    for rank in range(num_nodes):
        for name in store.listdir(layout.rank_dir(rank)):
            if name == "claim.json" or name.startswith("claim.stale-"):
                remove.append(root / layout.rank_dir(rank) / name)
    # os.walk never descends into a symlinked directory; a symlink named like
    # a temporary file is removed itself, never its target.
    for dirpath, _dirs, files in os.walk(root):
        if Path(os.path.relpath(dirpath, root)).parts[:1] == (layout.ARCHIVE,):
            continue  # archive/ itself only: a directory merely named archive-... is the run's
        remove.extend(Path(dirpath) / f for f in files
                      if f.startswith(".") and f.endswith(fsio.TMP_SUFFIX))
    return remove


def _unfinished_outputs(store: FsStore, run_dir: Path, config: RunConfig, manifest: Manifest,
                        first: int, last: int) -> tuple[list[Path], int]:
    """Outputs of actions no journal marks complete (to remove), and how many are kept."""
    remove: list[Path] = []
    kept = 0
    for rank in range(manifest.num_nodes):
        actions = kind(config.run.actions).build(config, rank=rank, num_nodes=manifest.num_nodes,
                                                 run_dir=run_dir)
        journal = read_record(store, layout.journal(rank), Journal, retry_s=1.0)
        if journal is not None and journal.run_id != manifest.run_id:
            journal = None
        for it in range(first, last + 1):
            for phase in Phase:
                outputs = [p for p in actions.partial_outputs(it, phase, rank)
                           if os.path.lexists(p)]
                if journal is not None and journal.is_done(it, phase):
                    kept += len(outputs)
                else:
                    remove.extend(outputs)
        actions.close()
    return remove, kept


def apply(recovery: RecoveryPlan) -> None:
    """Remove what the plan lists (beneath the run directory, never through a
    symlink), then fence every earlier daemon with a new generation."""
    store = FsStore(recovery.run_dir)
    for path in recovery.remove:
        fsio.remove_tree(path)
    manifest = read_record(store, layout.MANIFEST, Manifest, retry_s=2.0)
    if manifest is None:
        raise UsageError(f"{routing.display(recovery.run_dir)}/run.json vanished during recovery: is another "
                         "`coordinator recover` or `run --new-run` running?")
    bumped = dataclasses.replace(manifest, generation=recovery.generation)
    publish_record(store, layout.MANIFEST, bumped)


def describe(recovery: RecoveryPlan, *, dry_run: bool) -> str:
    verb = "would remove" if dry_run else "removed"
    lines = [f"recovery of {routing.display(recovery.run_dir)} at iteration {recovery.iteration}:"]
    if recovery.live:
        lines.append(f"  forced past live daemons: {', '.join(recovery.live)}")
    lines.append(f"  {verb} {len(recovery.remove)} file(s):")
    lines.extend(f"    {p.relative_to(recovery.run_dir)}" for p in recovery.remove)
    lines.append(f"  kept {recovery.kept_outputs} completed output(s)")
    lines.append(f"  generation {'would become' if dry_run else 'is now'} {recovery.generation}")
    if not dry_run:
        lines.append("  next: restart every node with its original `coordinator run` command")
    return "\n".join(lines)
