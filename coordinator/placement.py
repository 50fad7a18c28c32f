"""Which nodes roll out and which train, and how far rollout may run ahead.

Colocated (the default: `run.rollout_nodes` and `run.train_nodes` empty) every
node does both, one after the other, on the same GPUs.  Disaggregated, the
two sets of nodes are disjoint, as RLinf's component placement puts them:

    [run]
    train_nodes = "0"          # node ranks, "0", "0,3" or "0-1"
    rollout_nodes = "1-2"      # empty: every node that does not train
    max_off_policy_steps = 1   # 0: synchronous (the default)

With `max_off_policy_steps = k >= 1` (disaggregated only: rollout and training
on the same GPUs at once is out of scope) the rollout nodes roll out
iteration i+1's shard during phase 10 of iteration i, while the training
nodes train on iteration i's batch (`carries_next_rollout`).  A batch holds
only samples of policy versions >= i - k (`oldest_version`); the rollout
nodes drop staler groups and generate them again.

The master hosts the trainer group's rendezvous store (phase 9), so node 0
always trains.  Checked once at the master's start, against --num-nodes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from coordinator.errors import UsageError
from coordinator.phases import Phase

# More than a few steps off policy and truncated importance sampling no longer
# corrects much; prime-rl's own ceiling is 8.
MAX_OFF_POLICY_STEPS: Final = 8


def parse_ranks(text: str, *, key: str, num_nodes: int) -> tuple[int, ...]:
    """'0', '1-2', '0,2-3' as sorted node ranks, each inside 0..num_nodes-1."""
    ranks: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        lo, sep, hi = part.partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise UsageError(f"{key}={text!r}: {part!r} is not a node rank or a range; write "
                             "ranks and ranges separated by commas, e.g. 0 or 1-2 or 0,3") from None
        if first > last:
            raise UsageError(f"{key}={text!r}: the range {part!r} runs backwards; write {last}-"
                             f"{first}")
        outside = [r for r in (first, last) if not 0 <= r < num_nodes]
        if outside:
            raise UsageError(f"{key}={text!r}: node {outside[0]} is outside 0..{num_nodes - 1} "
                             f"(--num-nodes {num_nodes}); name nodes of this run")
        ranks.update(range(first, last + 1))
    return tuple(sorted(ranks))


def _ranges(ranks: Iterable[int]) -> str:
    return ",".join(str(r) for r in ranks)


@dataclass(frozen=True, kw_only=True)
class Placement:
    """The run's placement, checked: `rollout` and `train` as node ranks."""

    num_nodes: int
    rollout: tuple[int, ...]
    train: tuple[int, ...]
    max_off_policy_steps: int = 0

    @classmethod
    def of(cls, *, rollout_nodes: str, train_nodes: str, max_off_policy_steps: int,
           num_nodes: int) -> Placement:
        every = tuple(range(num_nodes))
        k = max_off_policy_steps
        if not 0 <= k <= MAX_OFF_POLICY_STEPS:
            raise UsageError(f"run.max_off_policy_steps={k} is outside 0..{MAX_OFF_POLICY_STEPS}:"
                             " give 0 (synchronous) or how many policy versions a sample may lag"
                             ", e.g. 1")
        if not rollout_nodes.strip() and not train_nodes.strip():
            if k:
                raise UsageError(
                    f"run.max_off_policy_steps={k} needs rollout and training on different "
                    "nodes (rollout and training on the same GPUs at once is not supported): "
                    "give the training nodes, e.g. --set run.train_nodes=0 (the others roll out)")
            return cls(num_nodes=num_nodes, rollout=every, train=every)
        train = parse_ranks(train_nodes, key="run.train_nodes", num_nodes=num_nodes) \
            if train_nodes.strip() else ()
        rollout = parse_ranks(rollout_nodes, key="run.rollout_nodes", num_nodes=num_nodes) \
            if rollout_nodes.strip() else tuple(r for r in every if r not in train)
        if not train:
            train = tuple(r for r in every if r not in rollout)
        both = sorted(set(rollout) & set(train))
        if both:
            raise UsageError(
                f"nodes {_ranges(both)} are in both run.rollout_nodes={rollout_nodes!r} and "
                f"run.train_nodes={train_nodes!r}: a disaggregated placement gives each node "
                "one role (leave both empty for rollout and training on every node)")
        idle = [r for r in every if r not in rollout and r not in train]
        if idle:
            raise UsageError(
                f"nodes {_ranges(idle)} neither roll out nor train (run.rollout_nodes="
                f"{rollout_nodes!r}, run.train_nodes={train_nodes!r}): give every node of "
                f"--num-nodes {num_nodes} a role")
        if not rollout or not train:
            raise UsageError(
                f"run.rollout_nodes={rollout_nodes!r}, run.train_nodes={train_nodes!r} leave "
                "no node to " + ("roll out" if not rollout else "train")
                + ": give each role at least one node")
        if 0 not in train:
            raise UsageError(
                f"run.train_nodes={train_nodes!r} leaves out node 0: the master hosts the "
                "trainer group's rendezvous, so it trains; e.g. --set run.train_nodes=0")
        return cls(num_nodes=num_nodes, rollout=rollout, train=train, max_off_policy_steps=k)

    @property
    def colocated(self) -> bool:
        return set(self.rollout) == set(self.train)

    @property
    def asynchronous(self) -> bool:
        return self.max_off_policy_steps > 0

    def rolls_out(self, rank: int) -> bool:
        return rank in self.rollout

    def trains(self, rank: int) -> bool:
        return rank in self.train

    def rollout_weights(self, weights: Iterable[float]) -> list[float]:
        """The rank weights with every node that does not roll out at zero."""
        return [w if self.rolls_out(r) else 0.0 for r, w in enumerate(weights)]

    def carries_next_rollout(self, phase: Phase, rank: int, iteration: int,
                             iterations: int) -> bool:
        """Whether `rank` rolls out iteration+1's shard in this phase: phase 10 of an
        asynchronous run, on a rollout node, when the run has a next iteration."""
        return (self.asynchronous and phase is Phase.TRAIN and self.rolls_out(rank)
                and iteration + 1 < iterations)

    def oldest_version(self, iteration: int) -> int:
        """The oldest policy version a sample of `iteration`'s batch may come from
        (version v: the policy trained through iteration v-1; 0 the initial one)."""
        return max(0, iteration - self.max_off_policy_steps)

    def describe(self) -> str:
        if self.colocated:
            return "colocated: every node rolls out and trains, synchronously"
        mode = (f"asynchronous, at most {self.max_off_policy_steps} policy version(s) behind"
                if self.asynchronous else "synchronous")
        return (f"disaggregated: nodes {_ranges(self.rollout)} roll out, nodes "
                f"{_ranges(self.train)} train; {mode}")
