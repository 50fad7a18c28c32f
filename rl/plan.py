"""Phases 0 and 13: an iteration's plan, and the clean-up once it is complete.

    0   all      check this node's reward (a reward file, node-local: rl/reward_check.py,
                 once per daemon)
        master   check the given model and data, build the demo model once (no
                 --model given), check the settings against the model and the tasks
                 (rl/preflight.py, once per daemon);
                 pick each split's tasks for this iteration and publish the shard plans
        decide   every rank scores with the same reward (rl/reward_check.py); the
                 policy this iteration samples from (PolicyChoice): the newest
                 published checkpoint, or the phase fails (rl/newest_policy.py)
    13  master   remove the previous iteration's rank files, the checkpoints beyond
                 checkpoint.keep but the best by checkpoint.keep_best (rl/keep_best.py)
                 and the training states older than the newest
"""

from __future__ import annotations

import errno
import json
import logging
import random
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coordinator.errors import ActionError
from coordinator.machine.actions import StepContext
from coordinator.records.records import Arrival
from coordinator.storage import fsio, trees
from coordinator.storage.store import read_document
from rl import keep_best, layout, newest_policy, node_local
from rl.contracts import INITIAL_POLICY, PolicyChoice
from rl.layout import Split
from rl.loop import Loop
from rl.reward_check import check_reward_here, same_reward
from rl.takeover import take_over_lost_tasks
from rollout.sharding import ShardPlan, throughput_weights
from trainer.architectures import ArchSpec

log = logging.getLogger(__name__)
# The demo model builds in seconds on a CPU; ten minutes means a stuck builder.
DEMO_MODEL_LOCK_TIMEOUT_S = 600.0


def publish_shard_plans(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 0: every node checks its reward; the master then shares the iteration's
    tasks of each split among the ranks."""
    reward = check_reward_here(loop, master=ctx.is_master)  # UsageError: every node exits 2
    if not ctx.is_master:
        return reward
    if not loop.checked:
        from rl.preflight import check_inputs

        check_inputs(loop)  # UsageError: every node exits 2, before the demo model is built
    ensure_initial_model(loop, ctx)
    if not loop.checked:
        from rl.preflight import check_loop

        check_loop(loop)  # UsageError: every node exits 2, before any engine starts
        loop.checked = True
    weights = loop.placement.rollout_weights(rank_weights(loop, ctx))
    for split in Split:
        if not loop.tasks(split):
            continue  # an empty split that is needed was refused by the check above
        publish_plan(loop, ctx, split, ctx.iteration, weights)
        if split is Split.TRAIN and loop.layout.rolls_out_ahead \
                and ctx.iteration + 1 < loop.config.run.iterations:
            # Rolled out by the rollout nodes during this iteration's phase 10.
            publish_plan(loop, ctx, split, ctx.iteration + 1, weights)
    return {"weights": weights, **reward}


def publish_plan(loop: Loop, ctx: StepContext, split: Split, iteration: int,
                 weights: list[float]) -> None:
    """A split's tasks of `iteration`, shared among the members by `weights`.

    In an asynchronous run the train split's plan of an iteration is made one
    iteration early, for the rollout that runs ahead, and then kept: rebuilt,
    it could move tasks whose groups a rank has already saved.  A member lost
    since is handled as within an iteration (rl/takeover.py)."""
    path = layout.shard_plan(loop.run_dir, iteration, split)
    if split is Split.TRAIN and loop.layout.rolls_out_ahead:
        found = loop.find_shard_plan(iteration, split)
        if found is not None and found.iteration == iteration:
            return
    ids = list(loop.tasks(split))
    size = loop.s.rollout.tasks_per_iteration if split is Split.TRAIN \
        else loop.s.rollout.eval_tasks
    seed = loop.config.run.seed
    if size and size < len(ids):
        # The iteration's subset: deterministic from (seed, iteration); eval
        # uses the same subset every time so accuracies compare.
        salt = iteration if split is Split.TRAIN else 0
        rng = random.Random(f"{seed}/{split.value}/{salt}")
        ids = rng.sample(ids, size)
    plan = ShardPlan.build(ids, weights, seed=seed, iteration=iteration, members=ctx.members)
    fsio.publish_bytes(path, plan.to_bytes())


def choose_policy(loop: Loop, ctx: StepContext,
                  arrivals: Mapping[int, Arrival]) -> Mapping[str, Any]:
    """Phase 0's decision: the newest published checkpoint before this iteration, or
    the phase fails naming it (rl/newest_policy.py: never an older one in its place);
    in a group that went on without some ranks, their unfinished tasks shared
    out among the others (rl/takeover.py).  First, every rank can score, with the
    same reward (rl/reward_check.py: UsageError, every node exits 2)."""
    same_reward(arrivals)
    budget = newest_policy.READ_SHARE * ctx.config.coordination.phase_timeouts_s.sync
    k = newest_policy.newest_published(
        ctx.iteration, lambda k: newest_policy.look(loop.run_dir, k, budget_s=budget),
        lambda k: layout.checkpoint(loop.run_dir, k))
    policy = INITIAL_POLICY if k is None else loop.relative(layout.checkpoint(loop.run_dir, k))
    log.info("iteration %d samples from %s", ctx.iteration, policy)
    return PolicyChoice(policy=policy).fields() | take_over_lost_tasks(loop, ctx)


def shard_plan(loop: Loop, iteration: int, split: Split) -> ShardPlan:
    """The master's plan of a split, read back by any rank."""
    plan = loop.find_shard_plan(iteration, split)
    if plan is None:
        path = layout.shard_plan(loop.run_dir, iteration, split)
        raise ActionError(f"the master's shard plan {path} is missing: run `coordinator "
                          f"recover --iteration {iteration}` and restart every node")
    return plan


def ensure_initial_model(loop: Loop, ctx: StepContext) -> None:
    """Build the demo model once when no --model was given."""
    if loop.s.model.path:
        if not (loop.initial_model() / "config.json").exists():
            raise ActionError(f"model.path {loop.s.model.path} has no config.json: give a "
                              "local Hugging Face model directory")
        return
    locks = node_local.lock_dir(node_local.run_root(ctx.run_id, loop.s.checkpoint.local_cache))
    with node_local.node_lock(locks, "demo-model", timeout_s=DEMO_MODEL_LOCK_TIMEOUT_S,
                              what="building the demo model"):
        build_demo_model(loop.initial_model(), seed=loop.s.model.init_seed,
                         warmstart_steps=loop.s.model.warmstart_steps)
        # Read as local files from here on (fetched once per node from a bucket).
        from trainer.local_view import local_view

        local_view(loop.initial_model())


def build_demo_model(target: Path, *, seed: int, warmstart_steps: int,
                     spec: ArchSpec | None = None) -> dict[str, Any]:
    """The tiny demo model at `target` (with `spec`, a model of that real architecture:
    `coordinator demo --arch`), unless it is there already (the caller holds what
    keeps two builders apart)."""
    if trees.exists(target / "manifest.json"):
        return {}
    what = "tiny demo model" if spec is None else f"{spec.arch.value} model"
    log.info("building the %s in %s (warm start: %d steps)", what, target, warmstart_steps)
    from trainer.warmstart import build_initial_model  # torch: only when needed

    report = build_initial_model(target, seed=seed, warmstart_steps=warmstart_steps, spec=spec)
    log.info("%s ready: %s", what, report)
    return report


def rank_weights(loop: Loop, ctx: StepContext) -> list[float]:
    """The run's weights; with 'auto', from the previous iteration's throughput."""
    if ctx.weights != "auto":
        return list(ctx.weights)
    if ctx.iteration == 0:
        return throughput_weights({}, loop.num_nodes)
    previous = layout.metrics(loop.run_dir, ctx.iteration - 1, "rollout")
    speeds: dict[int, float] = {}
    try:
        data = read_document(previous, lambda raw, _path: json.loads(raw))
        if not isinstance(data, dict):
            raise ValueError(f"{previous} is not a metrics object")
        speeds = {int(r): float(v) for r, v in data.get("samples_per_second", {}).items()}
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("rank weights 'auto': no throughput from %s (%s); equal weights",
                    previous, exc)
    return throughput_weights(speeds, loop.num_nodes)


def prune_train_states(loop: Loop, iteration: int) -> None:
    """The saved training states older than the newest complete one (a trainer started
    anew resumes from that one, trainer/train_state.py)."""
    from trainer.train_state import newest_complete
    from trainer.train_state import prune as prune_states

    root = layout.train_state(loop.run_dir)
    found = newest_complete(root, before=iteration + 1)
    if found is not None:
        for old in prune_states(root, keep=found[0]):
            log.info("pruned the training state of iteration %d (iteration %d's is newer)",
                     old, found[0])


def prune(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 13 (master): the previous iteration's rank files (unless
    rollout.keep_rank_files), checkpoints beyond checkpoint.keep except the best
    by checkpoint.keep_best (recorded first), and saved training states older
    than the newest complete one."""
    if not ctx.is_master:
        return {}
    if ctx.iteration > 0 and not loop.s.rollout.keep_rank_files:
        for split in Split:
            fsio.remove_tree(layout.split_dir(loop.run_dir, ctx.iteration - 1, split))
    keep, best = loop.s.checkpoint.keep, None
    present = keep_best.present(loop.run_dir)
    if loop.s.checkpoint.keep_best:
        chosen = keep_best.record_best(loop.run_dir, ctx.iteration,
                                       loop.s.checkpoint.best_metric, present=present)
        best = chosen.iteration if chosen is not None else None
    doomed = keep_best.prunable(present, iteration=ctx.iteration, keep=keep, best=best)
    needed = _chains(loop.run_dir, [k for k in present if k not in doomed])
    for k in doomed:
        path = layout.checkpoint(loop.run_dir, k)
        if needed is None or path.name in needed:
            continue  # a kept delta checkpoint's parent or base (or unknown: kept)
        if _remove_unless_busy(path):
            log.info("pruned %s (checkpoint.keep=%d)", path, keep)
    prune_train_states(loop, ctx.iteration)
    root = layout.checkpoints(loop.run_dir)
    if root.is_dir():
        for child in root.iterdir():
            if _leftover(child.name, ctx.iteration) and _remove_unless_busy(child):
                log.info("removed %s, left by an earlier attempt", child)
    return {}


# Hidden directories in checkpoints/ that no process writes once phase 11 published
# the iteration: an attempt set aside (rl/training.py), and a killed publisher's
# temporary (trainer/checkpoint.py tmp_sibling) or FSDP2 staging directory
# (trainer/sharded_save.py staging_dir) of an iteration up to this one.
_SET_ASIDE = re.compile(r"\.superseded-iter-\d+-[0-9a-f]+")
_UNFINISHED = re.compile(r"\.iter-(\d+)\.tmp-\d+-[0-9a-f]+|\.staging-iter-(\d+)")


def _leftover(name: str, iteration: int) -> bool:
    """Whether checkpoints/`name` is a leftover phase 13 of `iteration` removes."""
    if _SET_ASIDE.fullmatch(name):
        return True
    found = _UNFINISHED.fullmatch(name)
    return found is not None and int(found.group(1) or found.group(2)) <= iteration


def _chains(run_dir: Path, kept: list[int]) -> set[str] | None:
    """The checkpoints the kept ones are deltas of, down to their full bases
    (trainer/local_copy.py chain); None, pruning nothing, when a manifest on the
    way cannot be read."""
    from trainer.checkpoint import CheckpointError
    from trainer.local_copy import chain

    needed: set[str] = set()
    for k in sorted(kept, reverse=True):  # newest first: an older kept one is often in
        if layout.checkpoint(run_dir, k).name in needed:  # a newer one's chain already
            continue
        try:
            needed.update(chain(layout.checkpoint(run_dir, k)))
        except CheckpointError as exc:
            log.warning("no checkpoint pruned this iteration: the chain of iteration %d's "
                        "cannot be read (%s)", k, exc)
            return None
    return needed


def _remove_unless_busy(path: Path) -> bool | None:
    """remove_tree, or None when a file in `path` is still open somewhere on this
    node: NFS renames a removed open file to .nfsXXXX (FUSE to .fuse_hiddenXXXX)
    until it is closed, and the directory cannot go before it.  Tried again at
    the next iteration's phase 13."""
    try:
        return fsio.remove_tree(path)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EBUSY):
            raise
        log.info("kept %s until a later iteration: a process on this node still has a file "
                 "in it open (%s)", path, exc.strerror)
        return None
