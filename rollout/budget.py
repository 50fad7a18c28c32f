"""What a rollout may lose before its result is refused.

    failed samples   more than rollout.max_failed_fraction of the samples fail:
                       a rank's own shard        phases 1, 2, 6 and an asynchronous run's
                                                 10 (rl/rollouts.py), as soon as its failed
                                                 samples exceed what the budget allows for
                                                 the whole shard (the rest is not rolled
                                                 out), and before its manifest is marked
                                                 complete
                       the merged result         phases 4 and 6 (rollout/aggregate.py), as
                                                 soon as the ranks' sum does, and before the
                                                 batch or metrics are published
    train batch      empty, or fewer samples than rollout.min_batch_fraction of those
                     rolled out (phase 4): the iteration does not train on it

A failed sample is saved (its task id and error), never dropped, but it is
never taken as done: a manifest that is not complete lists groups with failed
samples only to have them redone (rollout/trajectory.py), so a rerun of the
phase redoes every failed sample or fails again.
"""

from __future__ import annotations

import math

from rollout.errors import BudgetError


def allowed_failures(samples: int, fraction: float) -> int:
    """The most failed samples of `samples` the budget accepts (more fail the phase)."""
    return math.floor(fraction * samples)


def check_failures(failed: int, *, samples: int, fraction: float, where: str,
                   first: str = "") -> None:
    """More than `fraction` of `samples` failed: BudgetError with the count, the
    limit and the first failure (which names its task)."""
    if samples and failed > fraction * samples:
        raise BudgetError(
            f"{failed} of {samples} {where} samples failed (limit "
            f"rollout.max_failed_fraction={fraction:g})"
            + (f"; first: {first}" if first else ""),
            setting="rollout.max_failed_fraction", value=failed / samples, limit=fraction)


def check_failures_so_far(failed: int, *, seen: int, planned: int, fraction: float,
                          where: str, first: str = "") -> None:
    """Fail fast: `failed` of the first `seen` samples already exceed what the budget
    allows for all `planned` of the phase, so no way the rest turn out can pass it:
    BudgetError naming the budget, the count and the first failure (its cause).
    Once all are seen, check_failures gives the verdict."""
    if seen < planned and failed > fraction * planned:
        raise BudgetError(
            f"{failed} of the first {seen} {where} samples failed: rollout.max_failed_fraction="
            f"{fraction:g} allows {allowed_failures(planned, fraction)} of the phase's "
            f"{planned}, so it stops now instead of going through the other {planned - seen}"
            + (f"; first: {first}" if first else ""),
            setting="rollout.max_failed_fraction", value=failed / planned, limit=fraction)


def check_batch(kept: int, *, rolled_out: int, fraction: float, iteration: int) -> None:
    """A train batch must hold samples, and at least `fraction` of those rolled out."""
    if kept > 0 and kept >= fraction * rolled_out:
        return
    share = kept / rolled_out if rolled_out else 0.0
    raise BudgetError(
        f"the train batch of iteration {iteration} would hold {kept} of the {rolled_out} "
        f"samples rolled out ({share:.0%}; rollout.min_batch_fraction={fraction:g}"
        + (", and an empty batch is never trained on" if kept == 0 else "")
        + "): failed samples and groups left with too few answers are not trained on; "
        "the iteration fails instead of publishing a model that learned from "
        + ("nothing" if kept == 0 else "scraps"),
        setting="rollout.min_batch_fraction", value=share, limit=fraction)
