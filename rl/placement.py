"""Which nodes, or which GPUs of a node, roll out and which train, and how far
rollout may run ahead.

Colocated (the default: `run.rollout_nodes` and `run.train_nodes` empty) every
node does both, one after the other, on the same GPUs.  Disaggregated, the
two roles get disjoint GPUs, as RLinf's component placement puts them: whole
nodes, or GPU ranges of one node (`R:G-H`, indices into the GPUs the daemon
sees, so into CUDA_VISIBLE_DEVICES when it is set):

    [run]
    train_nodes = "0"          # node ranks, "0", "0,3" or "0-1"
    rollout_nodes = "1-2"      # empty: every node that does not train
    max_off_policy_steps = 1   # 0: synchronous (the default)

    train_nodes = "0:0-3"      # GPUs 0-3 of node 0 train,
    rollout_nodes = "0:4-7,1"  # its GPUs 4-7 and all of node 1 roll out

A node with both roles (a split node) starts its engine on its rollout GPUs
and its trainer ranks on its train GPUs, and in phase 10 does both at once.

With `max_off_policy_steps = k >= 1` (disaggregated only: rollout and training
on the same GPUs at once is out of scope) the rollout nodes roll out
iteration i+1's shard during phase 10 of iteration i, while the training
nodes train on iteration i's batch (rl/run_layouts.py `rolls_out_next`).  A batch holds
only samples of policy versions >= i - k (`oldest_version`); the rollout
nodes drop staler groups and generate them again.

The master hosts the trainer group's rendezvous store (phase 9), so node 0
always trains.  Checked once at the master's start (`check_run`, the kinds'
ActionKind.check_run), against --num-nodes and the rank weights.

These are the rl kind's own `[run]` keys (`RlRunSection`): the coordinator's
phase machine never reads them; the rl kind and the scripted kind that
simulates its schedule (rl/scripted.py) declare them as their run_section.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from coordinator.config.run_config import RunConfig, RunSection, from_mapping, setting, to_plain
from coordinator.errors import UsageError
from coordinator.records.records import Weights

log = logging.getLogger(__name__)

# More than a few steps off policy and truncated importance sampling no longer
# corrects much; prime-rl's own ceiling is 8.
MAX_OFF_POLICY_STEPS: Final = 8


def _span(part: str, text: str, key: str, what: str) -> tuple[int, int]:
    lo, sep, hi = part.partition("-")
    try:
        first = int(lo)
        last = int(hi) if sep else first
    except ValueError:
        raise UsageError(f"{key}={text!r}: {part!r} is not a {what} or a range; write node "
                         "ranks and ranges separated by commas, e.g. 0 or 1-2 or 0,3, and a "
                         "node's GPUs as R:G-H, e.g. 0:4-7") from None
    if first > last:
        raise UsageError(f"{key}={text!r}: the range {part!r} runs backwards; write {last}-"
                         f"{first}")
    return first, last


def parse_placement(text: str, *, key: str, num_nodes: int) -> dict[int, tuple[int, ...] | None]:
    """'0', '1-2', '0,2-3', '0:0-3,1' as node rank -> its GPU indices (None: the
    whole node), each node inside 0..num_nodes-1."""
    nodes: dict[int, tuple[int, ...] | None] = {}
    for part in (p.strip() for p in text.split(",")):
        node_part, colon, gpu_part = part.partition(":")
        first, last = _span(node_part, text, key, "node rank")
        outside = [r for r in (first, last) if not 0 <= r < num_nodes]
        if outside:
            raise UsageError(f"{key}={text!r}: node {outside[0]} is outside 0..{num_nodes - 1} "
                             f"(--num-nodes {num_nodes}); name nodes of this run")
        if colon and first != last:
            raise UsageError(f"{key}={text!r}: {part!r} gives GPUs to a range of nodes; give "
                             f"each node's GPUs on their own, e.g. {first}:{gpu_part}")
        gpus: tuple[int, ...] | None = None
        if colon:
            lo, hi = _span(gpu_part, text, key, "GPU index")
            if lo < 0:
                raise UsageError(f"{key}={text!r}: GPU {lo} is below 0")
            gpus = tuple(range(lo, hi + 1))
        for rank in range(first, last + 1):
            if rank in nodes and (gpus is None or nodes[rank] is None):
                raise UsageError(f"{key}={text!r} names node {rank} twice, once as a whole "
                                 "node: give a node whole or by GPU ranges, not both")
            before = nodes.get(rank) or ()
            nodes[rank] = None if gpus is None else tuple(sorted({*before, *gpus}))
    return dict(sorted(nodes.items()))


def _ranges(ranks: Iterable[int]) -> str:
    return ",".join(str(r) for r in ranks)


def _span_text(values: tuple[int, ...]) -> str:
    return f"{values[0]}-{values[-1]}" if len(values) > 1 else str(values[0])


class Role(enum.Enum):
    ROLLOUT = "rollout"
    TRAIN = "train"


GpuRanges = tuple[tuple[int, tuple[int, ...]], ...]  # (node rank, its GPU indices)


@dataclass(frozen=True, kw_only=True)
class Placement:
    """The run's placement, checked: `rollout` and `train` as node ranks, and the
    GPU indices of the nodes given by GPU range."""

    num_nodes: int
    rollout: tuple[int, ...]
    train: tuple[int, ...]
    max_off_policy_steps: int = 0
    rollout_gpus: GpuRanges = ()
    train_gpus: GpuRanges = ()

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
                    "GPUs (rollout and training on the same GPUs at once is not supported): "
                    "give the training nodes, e.g. --set run.train_nodes=0 (the others roll "
                    "out), or a node's GPUs, e.g. train_nodes = \"0:0-3\", rollout_nodes = "
                    "\"0:4-7\"")
            return cls(num_nodes=num_nodes, rollout=every, train=every)
        Given = dict[int, tuple[int, ...] | None]
        train: Given = parse_placement(train_nodes, key="run.train_nodes",
                                       num_nodes=num_nodes) if train_nodes.strip() else {}
        rollout: Given = parse_placement(rollout_nodes, key="run.rollout_nodes",
                                         num_nodes=num_nodes) if rollout_nodes.strip() \
            else {r: None for r in every if r not in train}
        if not train:
            train = {r: None for r in every if r not in rollout}
        keys = f"run.rollout_nodes={rollout_nodes!r} and run.train_nodes={train_nodes!r}"
        whole = [r for r in rollout if r in train and (rollout[r] is None or train[r] is None)]
        if whole:
            raise UsageError(
                f"nodes {_ranges(whole)} are in both {keys}: a node has one role, or gives "
                "each role GPUs of its own (e.g. train_nodes = \"0:0-3\", rollout_nodes = "
                "\"0:4-7\"); leave both empty for rollout and training on every node")
        for r in (r for r in rollout if r in train):
            shared = sorted(set(rollout[r] or ()) & set(train[r] or ()))
            if shared:
                raise UsageError(f"GPUs {_ranges(shared)} of node {r} are in both {keys}: give "
                                 "each role disjoint GPUs of the node")
        idle = [r for r in every if r not in rollout and r not in train]
        if idle:
            raise UsageError(
                f"nodes {_ranges(idle)} neither roll out nor train ({keys}): give every node "
                f"of --num-nodes {num_nodes} a role")
        if not rollout or not train:
            raise UsageError(
                f"{keys} leave no node to " + ("roll out" if not rollout else "train")
                + ": give each role at least one node")
        if 0 not in train:
            raise UsageError(
                f"run.train_nodes={train_nodes!r} leaves out node 0: the master hosts the "
                "trainer group's rendezvous, so it trains; e.g. --set run.train_nodes=0")

        def ranges(given: dict[int, tuple[int, ...] | None]) -> GpuRanges:
            return tuple((r, g) for r, g in given.items() if g is not None)

        return cls(num_nodes=num_nodes, rollout=tuple(rollout), train=tuple(train),
                   max_off_policy_steps=k, rollout_gpus=ranges(rollout),
                   train_gpus=ranges(train))

    @property
    def colocated(self) -> bool:
        return set(self.rollout) == set(self.train) and not self.split_nodes

    @property
    def split_nodes(self) -> tuple[int, ...]:
        """The nodes that roll out on some of their GPUs and train on others."""
        return tuple(r for r in self.rollout if r in self.train and self.gpus(r, Role.ROLLOUT))

    @property
    def asynchronous(self) -> bool:
        return self.max_off_policy_steps > 0

    def rolls_out(self, rank: int) -> bool:
        return rank in self.rollout

    def trains(self, rank: int) -> bool:
        return rank in self.train

    def gpus(self, rank: int, role: Role) -> tuple[int, ...] | None:
        """The GPU indices `rank` gives `role`; None: all it has."""
        ranges = self.rollout_gpus if role is Role.ROLLOUT else self.train_gpus
        return dict(ranges).get(rank)

    def visible_devices(self, rank: int, role: Role, inherited: str | None) -> str | None:
        """CUDA_VISIBLE_DEVICES for `role`'s processes on `rank`: its GPU indices,
        taken from `inherited` (the daemon's own CUDA_VISIBLE_DEVICES) when it is
        set; None when the placement gives the role the whole node."""
        gpus = self.gpus(rank, role)
        if gpus is None:
            return None
        if inherited is None:
            return ",".join(map(str, gpus))
        seen = [d.strip() for d in inherited.split(",") if d.strip()]
        if gpus[-1] >= len(seen):
            key = "run.rollout_nodes" if role is Role.ROLLOUT else "run.train_nodes"
            raise UsageError(
                f"{key} gives node {rank}'s GPUs {_span_text(gpus)} to {role.value}, but this "
                f"node sees {len(seen)} (CUDA_VISIBLE_DEVICES={inherited!r}): GPU indices "
                f"count the visible GPUs from 0; give indices below {len(seen)}")
        return ",".join(seen[g] for g in gpus)

    def rollout_weights(self, weights: Iterable[float]) -> list[float]:
        """The rank weights with every node that does not roll out at zero."""
        return [w if self.rolls_out(r) else 0.0 for r, w in enumerate(weights)]

    def oldest_version(self, iteration: int) -> int:
        """The oldest policy version a sample of `iteration`'s batch may come from
        (version v: the policy trained through iteration v-1; 0 the initial one)."""
        return max(0, iteration - self.max_off_policy_steps)

    def _where(self, role: Role) -> str:
        nodes = self.rollout if role is Role.ROLLOUT else self.train
        whole = [r for r in nodes if self.gpus(r, role) is None]
        parts = [f"nodes {_ranges(whole)}"] if whole else []
        parts += [f"node {r} GPUs {_span_text(g)}"
                  for r in nodes if (g := self.gpus(r, role)) is not None]
        return ", ".join(parts)

    def describe(self) -> str:
        if self.colocated:
            return "colocated: every node rolls out and trains, synchronously"
        mode = (f"asynchronous, at most {self.max_off_policy_steps} policy version(s) behind"
                if self.asynchronous else "synchronous")
        return (f"disaggregated: {self._where(Role.ROLLOUT)} roll out, "
                f"{self._where(Role.TRAIN)} train; {mode}")


@dataclass(frozen=True, kw_only=True)
class RlRunSection(RunSection):
    """[run] with the placement keys; a single node may be given as a number
    (--set run.train_nodes=0)."""

    rollout_nodes: str | int = setting(
        "", "Ranks that roll out, e.g. '1-3' ('': every node run.train_nodes does not name; "
        "every node when both are empty; rl/placement.py).")
    train_nodes: str | int = setting(
        "", "Ranks that train, e.g. '0' ('': every node run.rollout_nodes does not name; "
        "every node when both are empty).")
    max_off_policy_steps: int = setting(
        0, "How many policy versions a sample may lag (0: the synchronous loop); 1 or more "
        "needs rollout and training on different nodes or GPUs (run.train_nodes, "
        "run.rollout_nodes).", ge=0, le=MAX_OFF_POLICY_STEPS)


def placement_of(config: RunConfig, num_nodes: int) -> Placement:
    """The run's placement, checked against the node count (UsageError).  A config
    resolved for a kind without these keys places every role on every node."""
    run = config.run
    if not isinstance(run, RlRunSection):
        run = from_mapping(RlRunSection, to_plain(run), "run")
    return Placement.of(rollout_nodes=str(run.rollout_nodes), train_nodes=str(run.train_nodes),
                        max_off_policy_steps=run.max_off_policy_steps, num_nodes=num_nodes)


def check_run(config: RunConfig, num_nodes: int, weights: Weights) -> Placement:
    """The placement of a new or resumed run, checked by the master before run.json
    is written: against the node count, the phase timeouts and the rank weights."""
    placement = placement_of(config, num_nodes)
    timeouts = config.coordination.phase_timeouts_s
    if placement.asynchronous and timeouts.train < timeouts.rollout:
        raise UsageError(
            f"coordination.phase_timeouts_s.train={timeouts.train:g} is below "
            f"phase_timeouts_s.rollout={timeouts.rollout:g}: in an asynchronous run phase 10 "
            "also carries the next iteration's rollout; give train at least the rollout's")
    if not placement.colocated:
        log.info("placement: %s", placement.describe())
        if not isinstance(weights, str) and not sum(placement.rollout_weights(weights)):
            raise UsageError(
                f"--rank-weights {','.join(f'{w:g}' for w in weights)} give the rollout nodes "
                f"{','.join(map(str, placement.rollout))} no work: give them weights above 0")
    return placement
