"""Phases 3-4: the master turns every rank's trajectories into the training batch.

    3   decide   pin each rank's manifest: the SHA-256 the rank reported (or, for a
                 rank that skipped phase 3 as done in its journal, of the manifest
                 as the master reads it now) goes into the release (PinnedManifests)
    4   master   check each rank's output against the shard plan and the merged
                 result against the budget (failed samples, the batch's size:
                 rollout/budget.py), write iterations/<N>/batch.pt and
                 metrics/rollout.json; a manifest is read only in its pinned form
                 (one changed since phase 3 fails the phase, naming both digests)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.errors import ActionError
from coordinator.machine.actions import StepContext
from coordinator.records.records import Arrival
from coordinator.storage import fsio
from rl import layout
from rl.contracts import PinnedManifests
from rl.layout import Split
from rl.loop import Loop
from rl.plan import shard_plan

if TYPE_CHECKING:
    from rollout.accumulator import AggregateMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MergeInputs:
    """What the master merges for one split: per rank with tasks, its output
    directory and the task ids the plan gives it, and for a rank the group went
    on without, the frozen copy of the manifest of what it saved."""

    rank_dirs: dict[int, Path]
    assignments: dict[int, Sequence[str]]
    frozen: dict[int, Path]


def merge_inputs(loop: Loop, iteration: int, split: Split) -> MergeInputs:
    plan = shard_plan(loop, iteration, split)
    ranks = [r for r in range(plan.num_ranks) if plan.tasks_for(r)]
    return MergeInputs(
        rank_dirs={r: layout.rank_dir(loop.run_dir, iteration, split, r) for r in ranks},
        assignments={r: plan.tasks_for(r) for r in ranks},
        frozen={r: layout.frozen_manifest(loop.run_dir, iteration, split, r)
                for r in plan.frozen if r in ranks})


def pinned_digests(ranks: Iterable[int], reported: Mapping[int, Any],
                   read: Callable[[int], str | None]) -> dict[int, str]:
    """Phase 3's decision, pure: each rank's manifest digest as it reported it; `read` (the
    master's own read of the manifest) only for a rank whose arrival carries none, as it
    skipped phase 3 done in its journal (a restarted group).  A rank with tasks and no
    manifest fails the phase, naming it."""
    pinned = {}
    for rank in sorted(ranks):
        digest = reported[rank] if rank in reported else read(rank)
        if not isinstance(digest, str):
            raise ActionError(
                f"rank {rank} has train tasks but reported no manifest digest at phase 3 "
                f"({digest!r}) and none can be read: its rollout output is missing; run "
                "phases 1-3 again (`coordinator recover`)")
        pinned[rank] = digest
    return pinned


def pin_manifests(loop: Loop, ctx: StepContext,
                  arrivals: Mapping[int, Arrival]) -> Mapping[str, Any]:
    """Phase 3's decision (master): the manifests phase 4 aggregates, by digest."""
    from rollout.aggregate import manifest_digest

    if not loop.trains:
        return {}
    inputs = merge_inputs(loop, ctx.iteration, Split.TRAIN)
    reported = {rank: a.payload["manifest_sha256"] for rank, a in arrivals.items()
                if "manifest_sha256" in a.payload}
    pinned = pinned_digests([r for r in inputs.rank_dirs if r not in inputs.frozen], reported,
                            lambda rank: manifest_digest(inputs.rank_dirs[rank]))
    return PinnedManifests(manifest_sha256={str(r): d for r, d in pinned.items()}).fields()


def aggregate_train(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 4 (master): the training batch and the rollout metrics."""
    from rollout.aggregate import aggregate_iteration
    from rollout.errors import AggregationError, BudgetError

    if not ctx.is_master or not loop.trains:
        return {}
    inputs = merge_inputs(loop, ctx.iteration, Split.TRAIN)
    pinned = PinnedManifests.read(ctx).by_rank()
    started = time.monotonic()
    try:
        metrics = aggregate_iteration(inputs.rank_dirs, inputs.assignments,
                                      frozen=inputs.frozen, iteration=ctx.iteration,
                                      manifest_sha256=pinned,
                                      group_size=loop.s.rollout.group_size,
                                      out_path=layout.batch(loop.run_dir, ctx.iteration),
                                      max_failed_fraction=loop.s.rollout.max_failed_fraction,
                                      min_batch_fraction=loop.s.rollout.min_batch_fraction,
                                      oldest_version=loop.placement.oldest_version(ctx.iteration)
                                      if loop.layout.off_policy else 0)
    except (AggregationError, BudgetError) as exc:
        raise ActionError(f"aggregation refused iteration {ctx.iteration}: {exc}") from exc
    fsio.publish_bytes(layout.metrics(loop.run_dir, ctx.iteration, "rollout"),
                       metrics.to_json().encode())
    log.info("iteration %d: reward mean %.3f, accuracy %.3f over %d samples (%.1f s)",
             ctx.iteration, metrics.reward_mean or 0.0, metrics.accuracy or 0.0,
             metrics.num_samples, time.monotonic() - started)
    warn_reward_timeouts(ctx.iteration, "train", metrics)
    if loop.layout.off_policy:
        log.info("iteration %d: samples per policy version %s, staleness max %d mean %.2f, "
                 "%d stale groups dropped and generated again", ctx.iteration,
                 metrics.policy_versions, metrics.staleness_max, metrics.staleness_mean,
                 metrics.stale_groups_dropped)
    return {"reward_mean": metrics.reward_mean, "samples": metrics.num_samples,
            "staleness_max": metrics.staleness_max,
            "train_samples": metrics.num_train_samples, "failed_samples": metrics.num_failed}


def warn_reward_timeouts(iteration: int, split: str, metrics: AggregateMetrics) -> None:
    """Phases 4 and 6: a WARNING when more than 1 % of the split's reward calls ran out of
    time (each scored 0 whatever the answer); metrics/<split>.json counts them anyway."""
    from rollout.reward_tally import timeout_warning

    line = timeout_warning(calls=metrics.reward_calls, timeouts=metrics.reward_timeouts,
                           iteration=iteration, split=split)
    if line is not None:
        log.warning("%s", line)
