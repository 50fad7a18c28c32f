"""The real RL loop behind the phase machine (`run.actions = "rl"`).

    phase  rank     action
    0      master   build the initial model if needed; shard the iteration's tasks
    1      all      roll out this rank's train shard, checkpointing every K groups
    2      all      make sure every assigned task is saved (redo missing groups)
    3      all      report the rank manifest's digest
    4      master   aggregate all ranks into the training batch + metrics
    6      all      eval rollout when phase 5 decided so; master merges eval metrics
    7      all      stop the engine, GPU memory released
    8-12   see rl/training.py (training job, torchrun, checkpoint, engine restart)
    13     master   prune rank files of the finished iteration and old checkpoints

Files (all under iterations/<N>/, see docs/PROTOCOL.md): `shard-train.json` and
`shard-eval.json` (master), `rollout/rank-<R>/` and `eval/rank-<R>/` (rank R:
chunk files + manifest), `batch.pt` and `metrics/{rollout,eval,train}.json`
(master).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from coordinator import fsio, layout
from coordinator.actions import ActionKind, StepContext
from coordinator.config import RunConfig
from coordinator.errors import ActionError
from coordinator.phases import Phase, RolloutSplit
from coordinator.records import Arrival
from coordinator.store import read_document
from rl.config import NODE_LOCAL_KEYS, RlSections, parse_sections, resolve_sections
from rollout.sharding import ShardPlan, throughput_weights
from rollout.tasks import Task, TaskSource, load_task_source

log = logging.getLogger(__name__)
SPLIT_DIR = {"train": "rollout", "eval": "eval"}


def shard_key(iteration: int, split: str) -> str:
    return f"{layout.iteration_dir(iteration)}/shard-{split}.json"


def rank_dir(run_dir: Path, iteration: int, split: str, rank: int) -> Path:
    return run_dir / layout.iteration_dir(iteration) / SPLIT_DIR[split] / f"rank-{rank}"


def metrics_path(run_dir: Path, iteration: int, name: str) -> Path:
    return run_dir / layout.iteration_dir(iteration) / "metrics" / f"{name}.json"


def group_seed(run_seed: int, iteration: int, split: str, task_id: str) -> int:
    """A sampling seed per group: a redone group samples the same way."""
    digest = hashlib.sha256(f"{run_seed}/{iteration}/{split}/{task_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class RlActions:
    def __init__(self, config: RunConfig, *, rank: int, num_nodes: int, run_dir: Path) -> None:
        self.config = config
        self.s: RlSections = parse_sections(config.sections)
        self.rank = rank
        self.num_nodes = num_nodes
        self.run_dir = run_dir
        self._tasks: TaskSource | None = None
        self._by_id: dict[str, dict[str, Task]] = {}
        from rl.engines import EngineHost
        from rl.training import TrainingSteps

        self.engines = EngineHost(self.s, rank=rank, run_dir=run_dir)
        self.training = TrainingSteps(self.s, rank=rank, num_nodes=num_nodes, run_dir=run_dir,
                                      engines=self.engines)

    # -- dispatch --------------------------------------------------------------
    def run(self, phase: Phase, ctx: StepContext) -> Mapping[str, Any]:
        split = self.config.run.rollout_split
        if phase is Phase.SYNC:
            return self._plan(ctx) if ctx.is_master else {}
        if phase in (Phase.ROLLOUT, Phase.ROLLOUT_DONE):
            if split is RolloutSplit.EVAL_ONLY:
                return {}
            return self._rollout(ctx, "train")
        if phase is Phase.TRAJECTORIES:
            return self._digest(ctx, "train") if split is not RolloutSplit.EVAL_ONLY else {}
        if phase is Phase.AGGREGATE:
            if ctx.is_master and split is not RolloutSplit.EVAL_ONLY:
                return self._aggregate(ctx)
            return {}
        if phase is Phase.EVAL:
            if ctx.release(Phase.EVAL_DECISION).get("eval"):
                return self._rollout(ctx, "eval")
            return {}
        if phase is Phase.STOP_ENGINE:
            self.engines.stop()
            return {}
        if phase in (Phase.PREPARE_TRAINING, Phase.READY_TO_TRAIN, Phase.TRAIN,
                     Phase.PUBLISH_CHECKPOINT, Phase.RESTART_ENGINE):
            return self.training.run(phase, ctx, trains=self._trains())
        if phase is Phase.FINAL_SYNC:
            if ctx.is_master:
                self._prune(ctx)
            return {}
        return {}

    def decide(self, phase: Phase, ctx: StepContext,
               arrivals: Mapping[int, Arrival]) -> Mapping[str, Any]:
        if phase is Phase.SYNC:
            return {"policy": self.training.policy_for(ctx.iteration)}
        if phase is Phase.EVAL and ctx.release(Phase.EVAL_DECISION).get("eval"):
            return {"eval_accuracy": self._merge_eval(ctx)}
        if phase is Phase.PUBLISH_CHECKPOINT:
            return self.training.announce(ctx, trains=self._trains())
        return {}

    def partial_outputs(self, iteration: int, phase: Phase, rank: int) -> list[Path]:
        base = self.run_dir / layout.iteration_dir(iteration)
        if phase is Phase.AGGREGATE and rank == 0:
            return [base / "batch.pt", metrics_path(self.run_dir, iteration, "rollout")]
        if phase is Phase.EVAL and rank == 0:
            return [metrics_path(self.run_dir, iteration, "eval")]
        if phase is Phase.PREPARE_TRAINING and rank == 0:
            return [base / "train" / "job.json"]
        # Rollout chunks are resumable and kept; the trainer's outputs are
        # superseded, never trusted, by a rerun (rl/training.py).
        return []

    def close(self) -> None:
        self.engines.close()

    # -- helpers -----------------------------------------------------------------
    def _trains(self) -> bool:
        return self.config.run.rollout_split is not RolloutSplit.EVAL_ONLY

    def _source(self) -> TaskSource:
        if self._tasks is None:
            self._tasks = load_task_source(self.s.data.path, seed=self.s.data.seed)
        return self._tasks

    def _task_index(self, split: str) -> dict[str, Task]:
        if split not in self._by_id:
            self._by_id[split] = {t.task_id: t for t in self._source().tasks(split)}
        return self._by_id[split]

    def _weights(self, ctx: StepContext) -> list[float]:
        if ctx.weights != "auto":
            return list(ctx.weights)
        previous = metrics_path(self.run_dir, ctx.iteration - 1, "rollout") \
            if ctx.iteration > 0 else None
        speeds: dict[int, float] = {}
        if previous is not None:
            try:
                data = read_document(previous, lambda raw, _path: json.loads(raw))
                if not isinstance(data, dict):
                    raise ValueError(f"{previous} is not a metrics object")
                speeds = {int(r): float(v) for r, v in data.get("samples_per_second", {}).items()}
            except (OSError, ValueError, AttributeError) as exc:
                log.warning("rank weights 'auto': no throughput from %s (%s); equal weights",
                            previous, exc)
        return throughput_weights(speeds, self.num_nodes)

    # -- phase 0 -------------------------------------------------------------------
    def _plan(self, ctx: StepContext) -> Mapping[str, Any]:
        self.training.ensure_initial_model(ctx)
        weights = self._weights(ctx)
        seed = self.config.run.seed
        sizes = {"train": self.s.rollout.tasks_per_iteration, "eval": self.s.rollout.eval_tasks}
        for split in ("train", "eval"):
            ids = list(self._task_index(split))
            if not ids:
                if split == "train" and self._trains():
                    raise ActionError(f"the train split of {self.s.data.path} has no tasks")
                continue
            if sizes[split] and sizes[split] < len(ids):
                # The iteration's subset: deterministic from (seed, iteration);
                # eval uses the same subset every time so accuracies compare.
                salt = ctx.iteration if split == "train" else 0
                rng = random.Random(f"{seed}/{split}/{salt}")
                ids = rng.sample(ids, sizes[split])
            plan = ShardPlan.build(ids, weights, seed=seed, iteration=ctx.iteration)
            fsio.publish_bytes(self.run_dir / shard_key(ctx.iteration, split),
                               plan.to_json().encode())
        return {"weights": weights}

    def _plan_for(self, iteration: int, split: str) -> ShardPlan:
        path = self.run_dir / shard_key(iteration, split)
        plan = read_document(path, lambda raw, where: ShardPlan.from_json(raw, source=str(where)))
        if plan is None:
            raise ActionError(f"the master's shard plan {path} is missing: run `coordinator "
                              f"recover --iteration {iteration}` and restart every node")
        return plan

    # -- phases 1, 2, 6 --------------------------------------------------------------
    def _rollout(self, ctx: StepContext, split: str) -> Mapping[str, Any]:
        from rl.rollouts import roll_out_shard

        plan = self._plan_for(ctx.iteration, split)
        assigned = list(plan.tasks_for(self.rank))
        policy = self.training.model_in_release(ctx, Phase.SYNC, "policy")
        index = self._task_index(split)
        missing = [t for t in assigned if t not in index]
        if missing:
            raise ActionError(f"shard plan names tasks unknown to {self.s.data.path}: "
                              f"{missing[:5]} ({len(missing)} in all)")
        group_size = self.s.rollout.group_size if split == "train" else \
            self.s.rollout.eval_group_size
        return roll_out_shard(
            ctx, self.s, split=split, tasks=[index[t] for t in assigned],
            out_dir=rank_dir(self.run_dir, ctx.iteration, split, self.rank),
            group_size=group_size, engines=self.engines, policy=policy,
            seed_of=lambda task_id: group_seed(self.config.run.seed, ctx.iteration, split,
                                               task_id),
        )

    def _digest(self, ctx: StepContext, split: str) -> Mapping[str, Any]:
        manifest = rank_dir(self.run_dir, ctx.iteration, split, self.rank) / "manifest.json"
        digest = read_document(manifest, lambda raw, _path: hashlib.sha256(raw).hexdigest())
        if digest is None and self._plan_for(ctx.iteration, split).tasks_for(self.rank):
            raise ActionError(f"rank {self.rank} has tasks but no manifest at {manifest}")
        return {"manifest_sha256": digest}

    # -- phase 4 and the phase-6 decision ---------------------------------------------------
    def _merge_inputs(self, iteration: int, split: str) -> tuple[dict[int, Path],
                                                                  dict[int, Sequence[str]]]:
        plan = self._plan_for(iteration, split)
        assignments = {r: plan.tasks_for(r) for r in range(self.num_nodes)}
        dirs = {r: rank_dir(self.run_dir, iteration, split, r) for r in range(self.num_nodes)}
        return dirs, assignments

    def _aggregate(self, ctx: StepContext) -> Mapping[str, Any]:
        from rollout.aggregate import AggregationError, aggregate_iteration

        dirs, assignments = self._merge_inputs(ctx.iteration, "train")
        out = self.run_dir / layout.iteration_dir(ctx.iteration) / "batch.pt"
        started = time.monotonic()
        try:
            metrics = aggregate_iteration(dirs, assignments, iteration=ctx.iteration,
                                          group_size=self.s.rollout.group_size, out_path=out)
        except AggregationError as exc:
            raise ActionError(f"aggregation refused iteration {ctx.iteration}: {exc}") from exc
        fsio.publish_bytes(metrics_path(self.run_dir, ctx.iteration, "rollout"),
                           metrics.to_json().encode())
        log.info("iteration %d: reward mean %.3f, accuracy %.3f over %d samples (%.1f s)",
                 ctx.iteration, metrics.reward_mean or 0.0, metrics.accuracy or 0.0,
                 metrics.num_samples, time.monotonic() - started)
        return {"reward_mean": metrics.reward_mean, "samples": metrics.num_samples}

    def _merge_eval(self, ctx: StepContext) -> float | None:
        from rollout.aggregate import AggregationError, merge_eval_metrics

        dirs, assignments = self._merge_inputs(ctx.iteration, "eval")
        try:
            metrics = merge_eval_metrics(dirs, assignments, iteration=ctx.iteration,
                                         group_size=self.s.rollout.eval_group_size)
        except AggregationError as exc:
            raise ActionError(f"eval merge refused iteration {ctx.iteration}: {exc}") from exc
        fsio.publish_bytes(metrics_path(self.run_dir, ctx.iteration, "eval"),
                           metrics.to_json().encode())
        log.info("iteration %d: eval accuracy %.3f over %d samples", ctx.iteration,
                 metrics.accuracy or 0.0, metrics.num_samples)
        return metrics.accuracy

    # -- phase 13 ------------------------------------------------------------------------
    def _prune(self, ctx: StepContext) -> None:
        """Rank files of the previous (completed) iteration; old checkpoints."""
        if ctx.iteration > 0 and not self.s.rollout.keep_rank_files:
            base = self.run_dir / layout.iteration_dir(ctx.iteration - 1)
            for name in SPLIT_DIR.values():
                fsio.remove_tree(base / name)
        self.training.prune_checkpoints(ctx.iteration)


def build(config: RunConfig, *, rank: int, num_nodes: int, run_dir: Path) -> RlActions:
    return RlActions(config, rank=rank, num_nodes=num_nodes, run_dir=run_dir)


KIND = ActionKind(name="rl", build=build, resolve_sections=resolve_sections,
                  node_local=NODE_LOCAL_KEYS)

__all__ = ["KIND", "RlActions", "build", "resolve_sections"]
