"""The fourteen phases of an iteration and the pure rules around them.

The table here is the one docs/PROTOCOL.md shows (a test compares them).
The decisions around them live in coordinator/machine/decisions.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final


class Phase(enum.IntEnum):
    SYNC = 0
    ROLLOUT = 1
    ROLLOUT_DONE = 2
    TRAJECTORIES = 3
    AGGREGATE = 4
    EVAL_DECISION = 5
    EVAL = 6
    STOP_ENGINE = 7
    PREPARE_TRAINING = 8
    READY_TO_TRAIN = 9
    TRAIN = 10
    PUBLISH_CHECKPOINT = 11
    RESTART_ENGINE = 12
    FINAL_SYNC = 13

    @property
    def label(self) -> str:
        return f"phase {int(self)} ({self.name.lower()})"


class Who(str, enum.Enum):
    MASTER = "master"
    ALL = "all"
    COLLECTIVE = "all (collective)"


class TimeoutKey(str, enum.Enum):
    SYNC = "sync"
    ROLLOUT = "rollout"
    AGGREGATE = "aggregate"
    ENGINE = "engine"
    TRAIN = "train"


@dataclass(frozen=True, kw_only=True)
class PhaseSpec:
    phase: Phase
    who: Who
    what: str
    release_carries: str
    timeout: TimeoutKey

    @property
    def collective(self) -> bool:
        return self.who is Who.COLLECTIVE


PHASES: Final[tuple[PhaseSpec, ...]] = (
    PhaseSpec(phase=Phase.SYNC, who=Who.ALL, timeout=TimeoutKey.SYNC, release_carries="-",
              what="sync all nodes at iteration start, each checking its reward; the master "
                   "publishes the iteration's shard plan"),
    PhaseSpec(phase=Phase.ROLLOUT, who=Who.ALL, timeout=TimeoutKey.ROLLOUT, release_carries="-",
              what="rollout of the train split, each rank its shard"),
    PhaseSpec(phase=Phase.ROLLOUT_DONE, who=Who.ALL, timeout=TimeoutKey.ROLLOUT, release_carries="-",
              what="rollout complete"),
    PhaseSpec(phase=Phase.TRAJECTORIES, who=Who.ALL, timeout=TimeoutKey.SYNC,
              release_carries="`manifest_sha256`",
              what="rank trajectory files published; the master pins each rank's manifest by digest"),
    PhaseSpec(phase=Phase.AGGREGATE, who=Who.MASTER, timeout=TimeoutKey.AGGREGATE, release_carries="-",
              what="master aggregates the rank files into the training batch"),
    PhaseSpec(phase=Phase.EVAL_DECISION, who=Who.MASTER, timeout=TimeoutKey.SYNC,
              release_carries="`eval`", what="master decides eval and publishes the decision"),
    PhaseSpec(phase=Phase.EVAL, who=Who.ALL, timeout=TimeoutKey.ROLLOUT, release_carries="eval metrics",
              what="eval rollout if decided, master aggregates"),
    PhaseSpec(phase=Phase.STOP_ENGINE, who=Who.ALL, timeout=TimeoutKey.ENGINE, release_carries="-",
              what="the rollout engine sleeps (or stops), GPU memory released"),
    PhaseSpec(phase=Phase.PREPARE_TRAINING, who=Who.MASTER, timeout=TimeoutKey.AGGREGATE,
              release_carries="-", what="master prepares the training data and config"),
    PhaseSpec(phase=Phase.READY_TO_TRAIN, who=Who.ALL, timeout=TimeoutKey.SYNC,
              release_carries="`group`, `start`, `master_addr`, `train_port`, `run`", what="all ready to train"),
    PhaseSpec(phase=Phase.TRAIN, who=Who.COLLECTIVE, timeout=TimeoutKey.TRAIN, release_carries="-",
              what="multi-node training"),
    PhaseSpec(phase=Phase.PUBLISH_CHECKPOINT, who=Who.MASTER, timeout=TimeoutKey.AGGREGATE,
              release_carries="`checkpoint`",
              what="master checks the checkpoint training published (manifest, file names) "
                   "and announces it"),
    PhaseSpec(phase=Phase.RESTART_ENGINE, who=Who.ALL, timeout=TimeoutKey.ENGINE, release_carries="-",
              what="every engine serves it (reloaded in place, or restarted), probes checked"),
    PhaseSpec(phase=Phase.FINAL_SYNC, who=Who.ALL, timeout=TimeoutKey.SYNC, release_carries="-",
              what="final sync"),
)
assert [s.phase for s in PHASES] == list(Phase), "PHASES must list every phase in order"


def spec(phase: Phase | int) -> PhaseSpec:
    return PHASES[int(phase)]
