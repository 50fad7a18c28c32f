"""The RL loop behind the phase machine (`run.actions = "rl"`): one function per phase.

`PHASE_WORK` is the table rl/__init__.py shows (a test compares them): for
each phase, the function that does its work on every rank (it returns at
once on ranks with nothing to do), and the master's decision once every
rank has arrived, when the phase has one.  To change what a phase does,
open its function.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from coordinator.config.run_config import RunConfig
from coordinator.machine.actions import ActionKind, StepContext
from coordinator.records.phases import Phase
from coordinator.records.records import Arrival, Weights
from rl import (
    aggregation,
    engines,
    evaluation,
    history,
    layout,
    placement,
    plan,
    reporting,
    rollouts,
    training,
)
from rl.config import NODE_LOCAL_KEYS, resolve_sections
from rl.loop import Loop
from rl.placement import RlRunSection
from rl.schedule import phases_of

Work = Callable[[Loop, StepContext], Mapping[str, Any]]
Decision = Callable[[Loop, StepContext, Mapping[int, Arrival]], Mapping[str, Any]]


@dataclass(frozen=True)
class PhaseWork:
    run: Work
    decide: Decision | None = None


PHASE_WORK: Final[Mapping[Phase, PhaseWork]] = {
    Phase.SYNC: PhaseWork(plan.publish_shard_plans, plan.choose_policy),
    Phase.ROLLOUT: PhaseWork(rollouts.roll_out_train, rollouts.same_agent),
    Phase.ROLLOUT_DONE: PhaseWork(rollouts.finish_train_rollout),
    Phase.TRAJECTORIES: PhaseWork(rollouts.report_trajectories, aggregation.pin_manifests),
    Phase.AGGREGATE: PhaseWork(aggregation.aggregate_train),
    Phase.EVAL_DECISION: PhaseWork(evaluation.await_eval_decision, evaluation.decide_eval),
    Phase.EVAL: PhaseWork(evaluation.roll_out_eval, evaluation.merge_eval),
    Phase.STOP_ENGINE: PhaseWork(engines.stop_engine),
    Phase.PREPARE_TRAINING: PhaseWork(training.write_train_job),
    Phase.READY_TO_TRAIN: PhaseWork(training.report_trainer, training.choose_trainer_group),
    Phase.TRAIN: PhaseWork(training.train),
    Phase.PUBLISH_CHECKPOINT: PhaseWork(training.verify_new_checkpoint,
                                        training.announce_checkpoint),
    Phase.RESTART_ENGINE: PhaseWork(engines.serve_new_policy),
    Phase.FINAL_SYNC: PhaseWork(reporting.end_iteration),
}
assert list(PHASE_WORK) == list(Phase), "PHASE_WORK must map every phase, in order"


class RlActions:
    """The coordinator's Actions interface over `PHASE_WORK`."""

    def __init__(self, config: RunConfig, *, rank: int, num_nodes: int, run_dir: Path) -> None:
        self.loop = Loop(config, rank=rank, num_nodes=num_nodes, run_dir=run_dir)

    def run(self, phase: Phase, ctx: StepContext) -> Mapping[str, Any]:
        return PHASE_WORK[phase].run(self.loop, ctx)

    def decide(self, phase: Phase, ctx: StepContext,
               arrivals: Mapping[int, Arrival]) -> Mapping[str, Any]:
        decide = PHASE_WORK[phase].decide
        return decide(self.loop, ctx, arrivals) if decide is not None else {}

    def partial_outputs(self, iteration: int, phase: Phase, rank: int) -> list[Path]:
        """What `recover` removes when a rank's journal does not mark the phase done.

        Rollout chunks are resumable and kept; the trainer's outputs are
        superseded, never trusted, by a rerun (rl/training.py).
        """
        run_dir = self.loop.run_dir
        if rank != 0:
            return []
        if phase is Phase.AGGREGATE:
            return [layout.batch(run_dir, iteration), layout.metrics(run_dir, iteration, "rollout")]
        if phase is Phase.EVAL:
            return [layout.metrics(run_dir, iteration, "eval")]
        if phase is Phase.PREPARE_TRAINING:
            return [layout.train_job(run_dir, iteration)]
        return []

    def close(self) -> None:
        self.loop.close()


def build(config: RunConfig, *, rank: int, num_nodes: int, run_dir: Path) -> RlActions:
    return RlActions(config, rank=rank, num_nodes=num_nodes, run_dir=run_dir)


def check_run(config: RunConfig, num_nodes: int, weights: Weights) -> None:
    """The placement (rl/placement.py), and its GPU ranges against the rl kind's
    settings (rl/loop.py)."""
    from rl.config import parse_sections
    from rl.loop import check_gpu_placement

    check_gpu_placement(parse_sections(config.sections), placement.check_run(
        config, num_nodes, weights))


KIND = ActionKind(name="rl", build=build, resolve_sections=resolve_sections,
                  runs_on_buckets=True, run_section=RlRunSection, check_run=check_run,
                  node_local=NODE_LOCAL_KEYS, summarize=history.summarize,
                  iteration_report=history.report, phases=phases_of,
                  run_outputs=(layout.TRAIN_STATE_DIR, layout.TENSORBOARD_DIR))

__all__ = ["KIND", "PHASE_WORK", "RlActions", "build"]
