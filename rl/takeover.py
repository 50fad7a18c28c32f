"""After a shrink: the tasks of the ranks the group went on without.

With coordination.on_failure "shrink" the group may go on without a lost
worker in the middle of an iteration (coordinator/machine/group.py).  Its rollout is
then cut in two, at phase 0's decision of the resumed iteration (the master):

    for each split's plan, each rank with tasks that is not in the session
    and not frozen yet:
        its chunks whose SHA-256 verifies   --> iterations/<N>/<split>/rank-<R>.frozen.json
        (and, unless the rank had accepted     (a complete manifest; the master's copy,
        its result, that hold no failed         so nothing a stale incarnation of the rank
        sample: rollout/trajectory.saved_work)  writes later is ever read)
        its other tasks                     --> the members, in proportion to their weights
    the plan is republished (ShardPlan.without: frozen ranks listed)
    the release asks every member to rerun phases 1-3 and 6 (coordinator
    decisions.RERUN): their journals may mark them done from before they got
    more tasks; a rerun rolls out only the groups not yet saved

Aggregation (phase 4) and the eval merge (phase 6) read a frozen rank's output
through its frozen manifest, so every task of the iteration is merged exactly
once: its saved groups from it, the rest from the members that took them.
A rank left out from the start of an iteration simply gets no task (phase 0's
plan is built over the members).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from coordinator.machine.actions import StepContext
from coordinator.machine.decisions import RERUN
from coordinator.records.phases import Phase
from coordinator.storage import fsio
from rl import layout
from rl.layout import Split
from rl.loop import Loop
from rollout.sharding import ShardPlan
from rollout.trajectory import saved_work

log = logging.getLogger(__name__)

# The phases that roll out a split: run again by every member after a takeover.
ROLLOUT_PHASES = {Split.TRAIN: (Phase.ROLLOUT, Phase.ROLLOUT_DONE, Phase.TRAJECTORIES),
                  Split.EVAL: (Phase.EVAL,)}


def take_over_lost_tasks(loop: Loop, ctx: StepContext) -> dict[str, Any]:
    """Phase 0's decision (master): freeze what lost ranks saved and share out the rest;
    returns the release's rerun request (empty while every planned rank is a member)."""
    rerun: set[int] = set()
    members = ctx.active_ranks
    for split in Split:
        plan = loop.find_shard_plan(ctx.iteration, split)
        if plan is None:
            continue
        lost = [r for r in range(plan.num_ranks)
                if r not in members and r not in plan.frozen and plan.tasks_for(r)]
        if lost:
            plan = _share_out(loop, ctx, split, plan, lost, members)
            fsio.publish_bytes(layout.shard_plan(loop.run_dir, ctx.iteration, split),
                               plan.to_bytes())
        if plan.frozen:
            rerun.update(int(p) for p in ROLLOUT_PHASES[split])
    return {RERUN: sorted(rerun)} if rerun else {}


def _share_out(loop: Loop, ctx: StepContext, split: Split, plan: ShardPlan, lost: list[int],
               members: tuple[int, ...]) -> ShardPlan:
    saved: dict[int, list[str]] = {}
    for rank in lost:
        work = saved_work(layout.rank_dir(loop.run_dir, ctx.iteration, split, rank),
                          rank=rank, iteration=ctx.iteration)
        assigned = set(plan.tasks_for(rank))
        kept = [c for c in work.chunks if set(c.task_ids) <= assigned]
        work = dataclasses.replace(work, chunks=tuple(kept))
        fsio.publish_bytes(layout.frozen_manifest(loop.run_dir, ctx.iteration, split, rank),
                           work.to_bytes())
        saved[rank] = work.task_ids()
    after = plan.without(saved, members)
    for rank in lost:
        log.warning(
            "iteration %d %s: rank %d left the group with %d of its %d tasks saved; its "
            "other %d go to ranks %s", ctx.iteration, split.value, rank, len(saved[rank]),
            len(plan.tasks_for(rank)), len(plan.tasks_for(rank)) - len(saved[rank]),
            list(members))
    return after
