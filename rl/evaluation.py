"""Phases 5 and 6: whether this iteration evaluates, and the eval rollout.

    5   all      nothing to do: the master decides
        decide   EvalDecision, from the schedule (rl/schedule.py ScheduleSection.evaluates)
    6   all      roll out this rank's eval shard when phase 5 said so
        decide   merge every rank's eval output into metrics/eval.json (EvalResult)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from coordinator.errors import ActionError
from coordinator.machine.actions import StepContext
from coordinator.records.records import Arrival
from coordinator.storage import fsio
from rl import layout
from rl.aggregation import merge_inputs, warn_reward_timeouts
from rl.contracts import EvalDecision, EvalResult
from rl.layout import Split
from rl.loop import Loop
from rl.rollouts import roll_out_shard

log = logging.getLogger(__name__)


def await_eval_decision(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 5 on every rank: no work; arriving says this rank is ready for the decision."""
    return {}


def decide_eval(loop: Loop, ctx: StepContext,
                arrivals: Mapping[int, Arrival]) -> Mapping[str, Any]:
    """Phase 5's decision, from the run's schedule."""
    return EvalDecision(eval=loop.s.schedule.evaluates(ctx.iteration)).fields()


def roll_out_eval(loop: Loop, ctx: StepContext) -> Mapping[str, Any]:
    """Phase 6: this rank's eval shard, when phase 5 decided to evaluate."""
    if not EvalDecision.read(ctx).eval:
        return {}
    return roll_out_shard(loop, ctx, Split.EVAL)


def merge_eval(loop: Loop, ctx: StepContext,
               arrivals: Mapping[int, Arrival]) -> Mapping[str, Any]:
    """Phase 6's decision: every rank's eval output checked and merged into metrics."""
    from rollout.aggregate import merge_eval_metrics
    from rollout.errors import AggregationError, BudgetError

    if not EvalDecision.read(ctx).eval:
        return {}
    inputs = merge_inputs(loop, ctx.iteration, Split.EVAL)
    try:
        metrics = merge_eval_metrics(inputs.rank_dirs, inputs.assignments,
                                     frozen=inputs.frozen, iteration=ctx.iteration,
                                     group_size=loop.s.rollout.eval_group_size,
                                     max_failed_fraction=loop.s.rollout.max_failed_fraction)
    except (AggregationError, BudgetError) as exc:
        raise ActionError(f"eval merge refused iteration {ctx.iteration}: {exc}") from exc
    fsio.publish_bytes(layout.metrics(loop.run_dir, ctx.iteration, "eval"),
                       metrics.to_json(batch=False).encode())
    log.info("iteration %d: eval accuracy %.3f over %d samples", ctx.iteration,
             metrics.accuracy or 0.0, metrics.num_samples)
    warn_reward_timeouts(ctx.iteration, "eval", metrics)
    return EvalResult(eval_accuracy=metrics.accuracy).fields()
