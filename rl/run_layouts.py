"""How a run is laid out on its nodes, and what each layout does: one table.

    layout         placement (rl/placement.py)     GPUs   phase 7  phase 10             aggregation
    colocated      every node rolls out and trains (the default)   shared parks    trains               on-policy
    disaggregated  whole nodes per role, max_off_policy_steps 0    own    -        trains               on-policy
    split node     as disaggregated, a node's GPUs split by role   own    -        trains (its train    on-policy
                                                                                   GPUs)
    asynchronous   disaggregated (whole or split nodes), k >= 1    own    -        trains, and rolls    versions >= i - k,
                                                                                   out iteration i+1    the rest again

`LAYOUTS` maps each `RunLayout` to its rule; the loop asks the rule (rl/engines.py
phase 7, rl/training.py phase 10, rl/plan.py and rl/rollouts.py the shards and
their versions, rl/aggregation.py phase 4, rl/loop.py where training state lives)
and never branches on the placement's booleans.  PROTOCOL.md's table is generated
from it (scripts/update_docs.py), and a test asserts every layout is reached by a
placement.  A new layout is one enum member, one entry and its rule in layout_of.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from rl.placement import Placement


class RunLayout(str, enum.Enum):
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"
    SPLIT_NODE = "split node"
    ASYNCHRONOUS = "asynchronous"


@dataclass(frozen=True, kw_only=True)
class LayoutRule:
    # Rollout and training take turns on the same GPUs: phase 7 parks the engines
    # (weights and KV cache released), training offloads its state between jobs
    # (train.offload "auto"), and the trainer hands the GPUs back after each job.
    shares_gpus: bool
    # Phase 10 also rolls out the next iteration's shard on the rollout nodes (phase 0
    # plans that shard one iteration early, and keeps it).
    rolls_out_ahead: bool
    # A batch may hold samples of older policy versions (down to i - k): aggregation
    # keeps those, drops staler groups (generated again), and the trainer corrects
    # by truncated importance sampling.
    off_policy: bool
    placement: str  # which placement gives this layout
    phase_7: str
    phase_10: str
    phase_12: str
    aggregation: str

    def rolls_out_next(self, *, rolls_out: bool, iteration: int, iterations: int) -> bool:
        """Whether a node rolls out iteration+1's shard during phase 10 of `iteration`:
        in a layout that rolls out ahead, on a rollout node (a split node while it
        also trains), when the run has a next iteration."""
        return self.rolls_out_ahead and rolls_out and iteration + 1 < iterations


_SERVE = ("the rollout nodes' running engines take the new checkpoint (reloaded in place, "
          "or restarted on it: engine.weight_update)")

LAYOUTS: Final[Mapping[RunLayout, LayoutRule]] = {
    RunLayout.COLOCATED: LayoutRule(
        shares_gpus=True, rolls_out_ahead=False, off_policy=False,
        placement="run.train_nodes and run.rollout_nodes empty: every node rolls out and "
                  "trains, one after the other (the default)",
        phase_7="every engine parks: asleep, or stopped, its GPU memory given to training",
        phase_10="every node trains",
        phase_12="each engine wakes on the new checkpoint (reloaded in place), or starts on "
                 "it",
        aggregation="every sample of the current policy"),
    RunLayout.DISAGGREGATED: LayoutRule(
        shares_gpus=False, rolls_out_ahead=False, off_policy=False,
        placement="whole nodes train (run.train_nodes) and others roll out; "
                  "run.max_off_policy_steps 0",
        phase_7="nothing: training has GPUs of its own, the engines keep theirs",
        phase_10="the training nodes train; the rollout nodes wait",
        phase_12=_SERVE,
        aggregation="every sample of the current policy"),
    RunLayout.SPLIT_NODE: LayoutRule(
        shares_gpus=False, rolls_out_ahead=False, off_policy=False,
        placement="as disaggregated, with a node's GPUs split between the roles "
                  "(train_nodes = \"0:0-3\", rollout_nodes = \"0:4-7\")",
        phase_7="nothing: the node's engine keeps its rollout GPUs",
        phase_10="the train GPUs train; the node's engine waits on its own GPUs",
        phase_12=_SERVE,
        aggregation="every sample of the current policy"),
    RunLayout.ASYNCHRONOUS: LayoutRule(
        shares_gpus=False, rolls_out_ahead=True, off_policy=True,
        placement="disaggregated, whole nodes or split ones, with run.max_off_policy_steps "
                  "k >= 1",
        phase_7="nothing: the engines keep their GPUs",
        phase_10="the training nodes train iteration i while the rollout nodes roll out "
                 "iteration i+1 (a split node does both at once)",
        phase_12=_SERVE + ", once the rollout ahead has ended",
        aggregation="samples of policy versions >= i - k; staler groups are dropped and "
                    "generated again"),
}
assert set(LAYOUTS) == set(RunLayout), "LAYOUTS must give every layout a rule"


def layout_of(placement: Placement) -> RunLayout:
    """The layout a checked placement gives the run."""
    if placement.colocated:
        return RunLayout.COLOCATED
    if placement.asynchronous:
        return RunLayout.ASYNCHRONOUS
    return RunLayout.SPLIT_NODE if placement.split_nodes else RunLayout.DISAGGREGATED


def rule_of(placement: Placement) -> LayoutRule:
    return LAYOUTS[layout_of(placement)]


def markdown_table() -> str:
    """PROTOCOL.md's run-layout table, from the table."""
    rows = ["| layout | placement | phase 7 | phase 10 | phase 12 | aggregation (phase 4) |",
            "|---|---|---|---|---|---|"]
    rows += [f"| {layout.value} | {r.placement} | {r.phase_7} | {r.phase_10} | {r.phase_12} | "
             f"{r.aggregation} |" for layout, r in LAYOUTS.items()]
    return "\n".join(rows)
