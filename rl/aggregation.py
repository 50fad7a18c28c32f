"""Phase 4: the master turns every rank's trajectories into the training batch.

    4   master   check each rank's output against the shard plan, write
                 iterations/<N>/batch.pt and metrics/rollout.json
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from coordinator import fsio
from coordinator.actions import StepContext
from coordinator.errors import ActionError
from rl import layout
from rl.layout import Split
from rl.loop import Loop
from rl.plan import shard_plan

log = logging.getLogger(__name__)


def merge_inputs(loop: Loop, iteration: int,
                 split: Split) -> tuple[dict[int, Path], dict[int, Sequence[str]]]:
    """Every rank's output directory and the task ids the plan assigned to it."""
    plan = shard_plan(loop, iteration, split)
    assignments: dict[int, Sequence[str]] = {r: plan.tasks_for(r) for r in range(loop.num_nodes)}
    dirs = {r: layout.rank_dir(loop.run_dir, iteration, split, r) for r in range(loop.num_nodes)}
    return dirs, assignments


def aggregate_train(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 4 (master): the training batch and the rollout metrics."""
    from rollout.aggregate import aggregate_iteration
    from rollout.errors import AggregationError

    if not ctx.is_master or not loop.trains:
        return {}
    dirs, assignments = merge_inputs(loop, ctx.iteration, Split.TRAIN)
    started = time.monotonic()
    try:
        metrics = aggregate_iteration(dirs, assignments, iteration=ctx.iteration,
                                      group_size=loop.s.rollout.group_size,
                                      out_path=layout.batch(loop.run_dir, ctx.iteration))
    except AggregationError as exc:
        raise ActionError(f"aggregation refused iteration {ctx.iteration}: {exc}") from exc
    fsio.publish_bytes(layout.metrics(loop.run_dir, ctx.iteration, "rollout"),
                       metrics.to_json().encode())
    log.info("iteration %d: reward mean %.3f, accuracy %.3f over %d samples (%.1f s)",
             ctx.iteration, metrics.reward_mean or 0.0, metrics.accuracy or 0.0,
             metrics.num_samples, time.monotonic() - started)
    return {"reward_mean": metrics.reward_mean, "samples": metrics.num_samples}
