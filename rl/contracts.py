"""What the RL loop's releases carry, as typed records.

A release's payload is a JSON object (docs/PROTOCOL.md, release).  The
fields the loop puts there are declared here as frozen records, parsed and
validated like every other record when a rank reads them back, so that a
missing, mistyped or hostile value is refused with the release's path:

    phase 0   PolicyChoice            the model this iteration samples from
    phase 3   PinnedManifests         each rank's manifest digest, what phase 4 aggregates
    phase 5   EvalDecision            whether this iteration evaluates
    phase 6   EvalResult              the merged eval accuracy
    phase 9   TrainRendezvous         the trainer group: kept, or new on the master's port
    phase 11  CheckpointAnnouncement  the checkpoint phase 12 serves

(The collective `run` flags of phase 9 are the phase machine's:
coordinator/machine/decisions.py `RunFlags`.)
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from coordinator.machine.actions import StepContext
from coordinator.records.layout import release as release_key
from coordinator.records.phases import Phase
from coordinator.records.records import Record

P = TypeVar("P", bound="Payload")

# What a release names instead of a path for the run's initial model: that
# model may live outside the run directory (model.path), and a release never
# carries an absolute path (PROTOCOL.md, threat model).
INITIAL_POLICY = "initial"


def policy_version(name: str) -> int:
    """A policy's version from the name a PolicyChoice gives it: 0 for the initial
    model, N+1 for checkpoints/iter-<N> (the policy trained through iteration N)."""
    if name == INITIAL_POLICY:
        return 0
    last = name.rstrip("/").rsplit("/", 1)[-1]
    prefix, _, number = last.partition("-")
    if prefix != "iter" or not number.isdigit():
        raise ValueError(f"policy {name!r} is neither {INITIAL_POLICY!r} nor a checkpoint "
                         "named iter-<N>")
    return int(number) + 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Payload(Record):
    """A release's fields for one phase."""

    PHASE: ClassVar[Phase]

    def fields(self) -> dict[str, Any]:
        """The payload entries, for a decision to return."""
        return {k: v for k, v in self.to_json().items() if k not in ("schema", "version")}

    @classmethod
    def read(cls: type[P], ctx: StepContext) -> P:
        """This phase's payload of the current iteration, as this rank received it."""
        where = ctx.run_dir / release_key(ctx.iteration, int(cls.PHASE))
        return cls.from_fields(dict(ctx.release(cls.PHASE)), Path(where))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyChoice(Payload):
    SCHEMA: ClassVar[str] = "rl/policy-choice"
    PHASE: ClassVar[Phase] = Phase.SYNC
    # "initial", or the newest checkpoint before this iteration, relative to the run directory
    policy: str


_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PinnedManifests(Payload):
    """Per rank with train tasks (its number as a string, a JSON key), the SHA-256 of its
    rank manifest as phase 3 found it: phase 4 aggregates exactly those bytes."""

    SCHEMA: ClassVar[str] = "rl/pinned-manifests"
    PHASE: ClassVar[Phase] = Phase.TRAJECTORIES
    manifest_sha256: dict[str, str]

    def __post_init__(self) -> None:
        for rank, digest in self.manifest_sha256.items():
            if not re.fullmatch(r"[0-9]{1,6}", rank) or not _SHA256.fullmatch(digest):
                raise ValueError(f"manifest_sha256 {{{rank!r}: {digest!r}}} is not a rank "
                                 "number and 64 hex digits")

    def by_rank(self) -> dict[int, str]:
        return {int(rank): digest for rank, digest in self.manifest_sha256.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalDecision(Payload):
    SCHEMA: ClassVar[str] = "rl/eval-decision"
    PHASE: ClassVar[Phase] = Phase.EVAL_DECISION
    eval: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalResult(Payload):
    SCHEMA: ClassVar[str] = "rl/eval-result"
    PHASE: ClassVar[Phase] = Phase.EVAL
    eval_accuracy: float | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainRendezvous(Payload):
    """The trainer group of phase 10: kept (`start` false: every member's resident
    trainer goes on), or new, on the master's address and the port it holds."""

    SCHEMA: ClassVar[str] = "rl/train-rendezvous"
    PHASE: ClassVar[Phase] = Phase.READY_TO_TRAIN
    group: str  # torchrun's rendezvous id: letters, digits and '-'
    start: bool
    master_addr: str
    train_port: int  # 0 when the group is kept

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9-]{1,80}", self.group):
            raise ValueError(f"group {self.group!r} is not 1-80 letters, digits or '-'")
        if self.start and not 0 < self.train_port < 65536:
            raise ValueError(f"train_port {self.train_port} is outside 1..65535")
        if not self.master_addr or any(c.isspace() for c in self.master_addr):
            raise ValueError(f"master_addr {self.master_addr!r} is not an address")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointAnnouncement(Payload):
    SCHEMA: ClassVar[str] = "rl/checkpoint-announcement"
    PHASE: ClassVar[Phase] = Phase.PUBLISH_CHECKPOINT
    checkpoint: str  # relative to the run directory


def announced(ctx: StepContext, cls: type[P]) -> P | None:
    """The payload if the phase's release carries it (a phase may have had no work)."""
    return cls.read(ctx) if ctx.release(cls.PHASE) else None
