"""Splitting an iteration's tasks among ranks in proportion to their weights.

    task ids --keyed hash sort (seed, iteration)--> permuted ids
             --Hamilton apportionment of len(ids) by weights--> counts per rank
             --contiguous slices--> assignments[rank]

The permutation sorts ids by a keyed hash, so it depends only on the set of
ids, the seed and the iteration: every node computes the same plan, whatever
order it read the tasks in, on any Python version.  Largest-remainder
(Hamilton) apportionment, computed in exact rational arithmetic, gives rank r
either floor or ceil of total * w_r / sum(w): within one task of its exact
share, with every task placed exactly once.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar, Final

from coordinator.records.records import Record
from rollout.errors import ShardingError
from rollout.rank_weights import check as check_weights

SHARD_PLAN_SCHEMA: Final = "coordinator/shard-plan"
# A measured-slow rank keeps at least this fraction of the fastest rank's
# weight, so it still gets tasks and its throughput is measured again; a rank
# at zero could never show that it has recovered.
MIN_RELATIVE_WEIGHT: Final = 0.05


def validate_weights(weights: Sequence[float]) -> tuple[float, ...]:
    """Weights as floats by the run's one rule (rollout/rank_weights.py), as a ShardingError."""
    try:
        return check_weights(weights)
    except ValueError as exc:
        raise ShardingError(f"rank weights {list(weights)!r}: {exc}") from None


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Hamilton apportionment: counts summing to total, each floor or ceil of its quota."""
    exact = [Fraction(w) for w in validate_weights(weights)]
    weight_sum = sum(exact)
    quotas = [total * w / weight_sum for w in exact]
    counts = [math.floor(q) for q in quotas]
    leftover = total - sum(counts)
    # Largest remainder first; ties go to the lower rank so the result is unique.
    order = sorted(range(len(quotas)), key=lambda r: (-(quotas[r] - counts[r]), r))
    for rank in order[:leftover]:
        counts[rank] += 1
    return counts


def _permutation_key(seed: int, iteration: int) -> bytes:
    return hashlib.sha256(f"shard-plan:{seed}:{iteration}".encode()).digest()[:32]


def shard_tasks(
    task_ids: Sequence[str], weights: Sequence[float], *, seed: int, iteration: int
) -> list[list[str]]:
    """assignments[rank] = the task ids rank must roll out this iteration."""
    if len(set(task_ids)) != len(task_ids):
        repeated = [t for t, n in Counter(task_ids).items() if n > 1]
        raise ShardingError(
            f"{len(repeated)} task ids repeat (first: {repeated[:10]}): task ids must be unique"
        )
    counts = apportion(len(task_ids), weights)
    key = _permutation_key(seed, iteration)
    permuted = sorted(
        task_ids,
        key=lambda t: (hashlib.blake2b(t.encode(), key=key, digest_size=16).digest(), t),
    )
    out, start = [], 0
    for count in counts:
        out.append(permuted[start : start + count])
        start += count
    return out


@dataclass(frozen=True, kw_only=True)
class ShardPlan(Record):
    """Which rank rolls out which tasks in one iteration; published by the master.

    A coordinator record (coordinator/records/records.py): written with to_bytes(),
    read with from_bytes(data, path), which reports a ShardingError of the
    decoded plan as a MalformedRecordError naming the file.
    """

    SCHEMA: ClassVar[str] = SHARD_PLAN_SCHEMA
    iteration: int
    seed: int
    weights: tuple[float, ...]
    assignments: tuple[tuple[str, ...], ...]
    # Ranks the group went on without (on_failure "shrink"): each keeps only the
    # tasks it had saved, read from the master's frozen copy of its manifest.
    frozen: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.iteration, bool) or not isinstance(self.iteration, int):
            raise ShardingError(f"iteration={self.iteration!r} is not an integer")
        if self.iteration < 0:
            raise ShardingError(f"iteration={self.iteration} is below 0: iterations count from 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ShardingError(f"seed={self.seed!r} is not an integer")
        object.__setattr__(self, "weights", validate_weights(self.weights))
        object.__setattr__(self, "assignments", tuple(tuple(a) for a in self.assignments))
        if len(self.assignments) != len(self.weights):
            raise ShardingError(
                f"plan has {len(self.weights)} weights but {len(self.assignments)} assignments: "
                "give one assignment per rank"
            )
        every = [t for shard in self.assignments for t in shard]
        if not all(isinstance(t, str) and t for t in every):
            raise ShardingError(
                "plan has an empty or non-string task id: ids are non-empty strings"
            )
        if len(set(every)) != len(every):
            raise ShardingError("plan assigns a task id twice: every task goes to exactly one rank")
        object.__setattr__(self, "frozen", tuple(sorted(set(self.frozen))))
        outside = [r for r in self.frozen if not 0 <= r < len(self.weights)]
        if outside:
            raise ShardingError(f"frozen ranks {outside} are outside 0..{len(self.weights) - 1}")

    @classmethod
    def build(
        cls, task_ids: Sequence[str], weights: Sequence[float], *, seed: int, iteration: int,
        members: Sequence[int] | None = None,
    ) -> ShardPlan:
        """The plan over every rank, or over `members` only (the others get no task)."""
        ranks = list(range(len(weights))) if members is None else sorted(members)
        shards = shard_tasks(task_ids, [weights[r] for r in ranks], seed=seed,
                             iteration=iteration)
        assignments: list[tuple[str, ...]] = [() for _ in weights]
        for rank, shard in zip(ranks, shards, strict=True):
            assignments[rank] = tuple(shard)
        return cls(iteration=iteration, seed=seed, weights=tuple(weights),
                   assignments=tuple(assignments))

    def without(self, saved: Mapping[int, Sequence[str]], members: Sequence[int]) -> ShardPlan:
        """The plan once the ranks of `saved` have left: each keeps only its saved task
        ids, and its other tasks go to `members` in proportion to their weights
        (keyed like every plan, so every node computes the same one)."""
        ranks = sorted(members)
        if not ranks or set(ranks) & set(saved):
            raise ShardingError(f"members {ranks} must be non-empty and exclude the ranks "
                                f"that left ({sorted(saved)})")
        assignments = [list(a) for a in self.assignments]
        orphans: list[str] = []
        for rank, kept in sorted(saved.items()):
            keep = set(kept)
            foreign = keep - set(assignments[rank])
            if foreign:
                raise ShardingError(f"rank {rank} saved task ids it was not given: "
                                    f"{sorted(foreign)[:5]}")
            orphans += [t for t in assignments[rank] if t not in keep]
            assignments[rank] = [t for t in assignments[rank] if t in keep]
        if orphans:
            shares = shard_tasks(orphans, [self.weights[r] for r in ranks], seed=self.seed,
                                 iteration=self.iteration)
            for rank, share in zip(ranks, shares, strict=True):
                assignments[rank] += share
        return ShardPlan(iteration=self.iteration, seed=self.seed, weights=self.weights,
                         assignments=tuple(tuple(a) for a in assignments),
                         frozen=(*self.frozen, *saved))

    @property
    def num_ranks(self) -> int:
        return len(self.weights)

    def tasks_for(self, rank: int) -> tuple[str, ...]:
        if not 0 <= rank < self.num_ranks:
            raise ShardingError(f"rank {rank} is outside this plan's ranks 0..{self.num_ranks - 1}")
        return self.assignments[rank]

    def as_mapping(self) -> dict[int, tuple[str, ...]]:
        """rank -> task ids, the shape aggregate_iteration takes."""
        return dict(enumerate(self.assignments))


def throughput_weights(samples_per_second: Mapping[int, float], num_ranks: int) -> list[float]:
    """Weights for `--rank-weights auto` from last iteration's measured throughput.

    Ranks without a usable measurement (missing, non-finite or not positive)
    get the mean of the measured ones; with no measurement at all, every rank
    weighs 1.  Each weight is then raised to at least MIN_RELATIVE_WEIGHT of
    the largest, and the result is scaled to mean 1 for readable logs.
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ShardingError(f"num_ranks={num_ranks!r} is below 1: give the number of ranks")
    for rank in samples_per_second:
        if not 0 <= rank < num_ranks:
            raise ShardingError(
                f"throughput measured for rank {rank}, outside ranks 0..{num_ranks - 1}: "
                "drop measurements of ranks that left the run"
            )
    measured = {
        r: float(v)
        for r, v in samples_per_second.items()
        if isinstance(v, int | float) and math.isfinite(v) and v > 0
    }
    if not measured:
        return [1.0] * num_ranks
    fill = sum(measured.values()) / len(measured)
    raw = [measured.get(r, fill) for r in range(num_ranks)]
    floor = MIN_RELATIVE_WEIGHT * max(raw)
    clamped = [max(w, floor) for w in raw]
    mean = sum(clamped) / num_ranks
    return [w / mean for w in clamped]
