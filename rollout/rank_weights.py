"""Rank weights: each node's share of the rollout work, checked by one rule.

`--rank-weights 2,1,1` (or `auto`) is parsed and checked once at the command
line (`parse`, against --num-nodes).  run.json records the result; the
protocol only checks that it holds one finite number per node
(coordinator/records/records.py `Manifest`), and the shard planner applies
`check` again to what it reads back (rollout/sharding.py: run.json is
untrusted, a boundary of its own).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from coordinator.records.records import Weights


def check(values: Sequence[object], *, num_nodes: int | None = None) -> tuple[float, ...]:
    """The weights as floats, or ValueError naming the bad one and the fix."""
    if num_nodes is not None and len(values) != num_nodes:
        example = ",".join("1" for _ in range(num_nodes))
        raise ValueError(f"has {len(values)} values but --num-nodes is {num_nodes}: give one "
                         f"weight per node, e.g. {example}")
    if not values:
        raise ValueError("no weights: give one weight per node, e.g. 1,1")
    out = []
    for rank, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"the weight of rank {rank}, {value!r}, is not a number")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"the weight of rank {rank}, {value}, is negative or not finite: "
                             "weights are shares of the work, numbers >= 0, e.g. 2,1,1")
        out.append(float(value))
    if sum(out) <= 0:
        raise ValueError(f"the weights {out} sum to zero: at least one node must get work, "
                         "e.g. 1,1,1")
    return tuple(out)


def parse(text: str, *, num_nodes: int | None = None) -> Weights:
    """`--rank-weights` as typed: comma-separated numbers, or `auto`; one per node
    when the node count is known."""
    if text.strip() == "auto":
        return "auto"
    values: list[float] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            values.append(float(part))
        except ValueError:
            raise ValueError(f"{part!r} is not a number; give comma-separated numbers, one per "
                             "node, e.g. 2,1,1, or 'auto'") from None
    return check(values, num_nodes=num_nodes)
