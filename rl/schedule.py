"""Which part of the RL loop a run executes, and when it evaluates: the [schedule] section.

    rl_phase          both     phases 0-13: roll out, evaluate, train, serve
                      rollout  phases 0-6: roll out and evaluate the given model only
                      update   phases 7-13: train on batches already aggregated
    rollout_split     both | train-only | eval-only: which task splits the
                      rollout phases cover (eval-only: no training at all)
    eval_interval     K: evaluate every K-th iteration (0: never)
    eval_before_train evaluate the initial model in iteration 0

These are rules of the RL loop, not of the coordination protocol: the phase
machine learns which phases run from the action kind (`ActionKind.phases`,
here `phases_of`), never from these settings.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from coordinator.config.run_config import RunConfig, from_mapping
from coordinator.config.settings import Section, setting
from coordinator.records.phases import Phase


class RlPhase(str, enum.Enum):
    """Which half of the loop this run executes (`--rl-phase`)."""

    BOTH = "both"
    ROLLOUT = "rollout"
    UPDATE = "update"

    @property
    def phases(self) -> tuple[Phase, ...]:
        if self is RlPhase.ROLLOUT:
            return tuple(p for p in Phase if p <= Phase.EVAL)
        if self is RlPhase.UPDATE:
            return tuple(p for p in Phase if p >= Phase.STOP_ENGINE)
        return tuple(Phase)


class RolloutSplit(str, enum.Enum):
    """Which task splits the rollout phases cover (`--rollout-split`)."""

    TRAIN_ONLY = "train-only"
    EVAL_ONLY = "eval-only"
    BOTH = "both"


@dataclass(frozen=True, kw_only=True)
class ScheduleSection(Section):
    """Which phases of the loop run, and when the run evaluates."""

    SECTION: ClassVar[str] = "schedule"

    rl_phase: RlPhase = setting(
        RlPhase.BOTH, "Which phases run: both (0-13), rollout (0-6: roll out and evaluate the "
        "given model only) or update (7-13: train on batches already aggregated).",
        flag="--rl-phase")
    rollout_split: RolloutSplit = setting(
        RolloutSplit.BOTH, "Which task splits the rollout phases cover: both, train-only or "
        "eval-only (no training at all).", flag="--rollout-split")
    eval_interval: int = setting(
        2, "Evaluate every K-th iteration (0: never).", unit="iterations", ge=0,
        flag="--eval-interval",
        fix="use 0 to never evaluate, K to evaluate every K-th iteration")
    eval_before_train: bool = setting(
        True, "Evaluate the initial model in iteration 0.", flag="--eval-before-train")

    @property
    def trains(self) -> bool:
        """False with --rollout-split eval-only: no train rollout, no training."""
        return self.rollout_split is not RolloutSplit.EVAL_ONLY

    def evaluates(self, iteration: int) -> bool:
        """The phase-5 eval schedule.

        Iteration i samples from the model trained i times, so iteration 0
        evaluates the initial model: only with `--eval-before-train`.  Unlike
        the rule we replace (`i % K == 1`), K = 1 evaluates every iteration.
        """
        if self.rollout_split is RolloutSplit.TRAIN_ONLY:
            return False
        if self.rollout_split is RolloutSplit.EVAL_ONLY:
            return True
        if self.eval_interval <= 0:
            return False
        if iteration == 0:
            return self.eval_before_train
        return iteration % self.eval_interval == 0


def schedule_of(sections: Mapping[str, Any]) -> ScheduleSection:
    return from_mapping(ScheduleSection, sections.get("schedule", {}), "schedule")


def phases_of(config: RunConfig) -> tuple[Phase, ...]:
    """The phases an RL run executes (ActionKind.phases of the rl kind)."""
    return schedule_of(config.sections).rl_phase.phases
