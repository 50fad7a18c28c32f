"""What a rollout may lose before its result is refused.

    failed samples   more than rollout.max_failed_fraction of the samples fail:
                       a rank's own shard        phases 1, 2 and 6 (rl/rollouts.py),
                                                 before its manifest is marked complete
                       the merged result         phases 4 and 6 (rollout/aggregate.py),
                                                 before the batch or metrics are published
    train batch      empty, or fewer samples than rollout.min_batch_fraction of those
                     rolled out (phase 4): the iteration does not train on it

A failed sample is saved (its task id and error), never dropped, but it is
never taken as done: a manifest that is not complete lists groups with failed
samples only to have them redone (rollout/trajectory.py), so a rerun of the
phase redoes every failed sample or fails again.
"""

from __future__ import annotations

from rollout.errors import BudgetError


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
