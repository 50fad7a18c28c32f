"""Phase 13: the iteration's metrics where researchers look, then the clean-up.

    13  master   one set of scalars per iteration (step = iteration):
                   rollout/*  reward, accuracy, response lengths, samples per second,
                              staleness (iteration minus the samples' policy versions);
                              rollout/reward/<name>: each number a reward file's
                              compute_score reported beside its score, averaged
                   eval/*     the same for the eval split, when it ran
                   train/*    loss, KL, grad norm, clip fraction, lr, tokens per second,
                              world size
                   phase_s/*  seconds of each phase 0-12 as the master saw it (its
                              action plus its wait for the others: the group's time)
                 --> TensorBoard event files in <run dir>/tensorboard/ (torch's
                     SummaryWriter, which writes with tensorboard's own event-file
                     writer), unless metrics.tensorboard = false
                 --> Weights & Biases when metrics.wandb_project is set and wandb is
                     installed (the optional extra `coordinator[wandb]`)
                 then prune (rl/plan.py)

A rerun of phase 13 (after a failure) reopens the writer with purge_step at
the iteration, so TensorBoard keeps one point per iteration.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Mapping
from typing import Any

from coordinator.machine.actions import StepContext
from coordinator.records.phases import Phase
from coordinator.storage import trees
from rl import history, layout, plan
from rl.loop import Loop
from rollout.rewards import METRIC_NAME

log = logging.getLogger(__name__)

# Eval keeps every group and samples on the policy it evaluates: its metrics file
# carries the batch's keys (dropped groups, staleness) as 0, measured by nothing.
EVAL_KEYS = ("reward_mean", "reward_std", "accuracy", "response_length_mean",
             "response_length_max", "num_failed")
ROLLOUT_KEYS = (*EVAL_KEYS, "num_dropped_groups", "staleness_max", "staleness_mean",
                "stale_groups_dropped")
TRAIN_KEYS = ("loss", "kl", "grad_norm", "clip_fraction", "ratio_mean", "lr", "world_size",
              "samples", "tokens", "seconds", "logprob_mismatch_mean_abs",
              "logprob_mismatch_max_abs", "tis_weight_mean", "tis_truncated_fraction")


def end_iteration(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 13: the master reports the iteration's scalars, then prunes; in a bucket
    every rank sends its processes' logs (node-local files) along."""
    trees.send_local_files(layout.logs(loop.run_dir, loop.rank), replace=True)
    if ctx.is_master:
        scalars = iteration_scalars(loop, ctx)
        if loop.s.metrics.tensorboard:
            write_tensorboard(loop, ctx.iteration, scalars)
        if loop.s.metrics.wandb_project:
            log_wandb(loop, ctx, scalars)
    return plan.prune(loop, ctx)


def iteration_scalars(loop: Loop, ctx: StepContext) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, keys in (("rollout", ROLLOUT_KEYS), ("eval", EVAL_KEYS),
                       ("train", TRAIN_KEYS)):
        metrics = _metrics(loop, ctx.iteration, name)
        for key in keys:
            _put(out, f"{name}/{key}", metrics.get(key))
        if name != "train":
            out.update(reward_scalars(name, metrics))
            speeds = metrics.get("samples_per_second")
            if isinstance(speeds, dict) and speeds:
                _put(out, f"{name}/samples_per_second",
                     sum(v for v in speeds.values() if isinstance(v, int | float)))
    if "train/tokens" in out and "train/seconds" in out:
        _put(out, "train/tokens_per_second", out["train/tokens"] / max(out["train/seconds"], 1e-9))
    for phase in Phase:
        timing = ctx.timings.get(str(int(phase)))
        if timing is not None:
            _put(out, f"phase_s/{int(phase):02d}_{phase.name.lower()}",
                 timing.get("action_s", 0.0) + timing.get("wait_s", 0.0))
    return out


def reward_scalars(split: str, metrics: Mapping[str, Any]) -> dict[str, float]:
    """<split>/reward/<name> for each number the reward reported beside its score
    (metrics' reward_extra); a name that is no plain metric name is left out, as the
    file is the run directory's."""
    out: dict[str, float] = {}
    extra = metrics.get("reward_extra")
    for key, value in sorted(extra.items() if isinstance(extra, dict) else ()):
        if isinstance(key, str) and METRIC_NAME.fullmatch(key):
            _put(out, f"{split}/reward/{key}", value)
    return out


def _put(out: dict[str, float], key: str, value: object) -> None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        out[key] = float(value)


def _metrics(loop: Loop, iteration: int, name: str) -> dict[str, Any]:
    """The metrics file, or nothing (eval runs only some iterations)."""
    return history.read_metrics(loop.run_dir, iteration, name) or {}


def write_tensorboard(loop: Loop, iteration: int, scalars: Mapping[str, float]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(layout.tensorboard_dir(loop.run_dir)),
                           purge_step=iteration)
    try:
        for key, value in sorted(scalars.items()):
            writer.add_scalar(key, value, global_step=iteration)
    finally:
        writer.close()
    # In a bucket the writer's files are node-local until sent (one small file a call).
    trees.send_local_files(layout.tensorboard_dir(loop.run_dir), replace=False)


def log_wandb(loop: Loop, ctx: StepContext, scalars: Mapping[str, float]) -> None:
    """One W&B run per coordinator run (its id), resumed by a restarted master."""
    if loop.wandb is None:
        try:
            wandb = importlib.import_module("wandb")
        except ImportError:
            log.warning("metrics.wandb_project=%r is set but wandb is not installed: pip "
                        "install 'coordinator[wandb]' on the master; reporting to TensorBoard "
                        "only", loop.s.metrics.wandb_project)
            return
        loop.wandb = wandb.init(
            project=loop.s.metrics.wandb_project, entity=loop.s.metrics.wandb_entity or None,
            id=ctx.run_id, name=f"coordinator-{ctx.run_id}", resume="allow",
            dir=str(loop.run_dir), config=dict(loop.config.sections))
    loop.wandb.log(dict(scalars), step=ctx.iteration)
