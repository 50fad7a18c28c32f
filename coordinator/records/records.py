"""The records daemons exchange through the run directory.

Each record is a frozen dataclass with a schema name; on disk it is a JSON
object whose first fields are `schema` and `version`.  Parsing is strict:
every declared field must be present with the declared type (ranks and
iterations range-checked), unknown fields are ignored so that newer writers
can add fields.  docs/PROTOCOL.md describes each record and its writer.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import typing
from pathlib import Path
from typing import Any, ClassVar, Final, Literal, TypeVar

from coordinator.errors import ExitCode, MalformedRecordError
from coordinator.records import codec
from coordinator.records.bounds import (
    MAX_ITERATIONS,
    MAX_RANKS,
    check_generation,
    check_iteration,
    check_phase,
    check_pid,
    check_point,
    check_rank,
    check_run_id,
)

VERSION: Final = 1
JsonObject = dict[str, Any]
# Each rank's share of the work as --rank-weights gave it, or "auto".  The
# protocol records and compares them; what a share means, and the rule they
# obey, belong to the action kind (the rl kind: rollout/rank_weights.py).
Weights = tuple[float, ...] | Literal["auto"]


class NodeState(str, enum.Enum):
    """A daemon's lifecycle, as its heartbeat reports it.

    starting -> running <-> waiting -> finished
                   |-> step-failed -> (the master's verdict) -> failed | left
                   |-> regrouping -> running   (coordination.on_failure "wait")
                   \\-> failed | left   (from any state)

    step-failed: this rank's action failed in a collective phase; it lives on
    and waits for the master to decide whether a lost peer caused it.
    regrouping: a rank was lost or a step failed; this daemon stopped its work
    and waits for the group to re-form (coordinator/machine/regroup.py).
    """

    STARTING = "starting"
    RUNNING = "running"
    WAITING = "waiting"
    STEP_FAILED = "step-failed"
    REGROUPING = "regrouping"
    FINISHED = "finished"
    LEFT = "left"
    FAILED = "failed"


# A daemon in one of these states is running (its heartbeat should advance).
LIVE_STATES: Final = (NodeState.STARTING, NodeState.RUNNING, NodeState.WAITING,
                      NodeState.STEP_FAILED, NodeState.REGROUPING)
# A daemon in one of these states is out of any session: the master may form
# a new session with it.
JOINABLE_STATES: Final = (NodeState.STARTING, NodeState.REGROUPING)


class AbortKind(str, enum.Enum):
    """Why the master stopped the group; decides every daemon's exit code."""

    LOST = "lost"  # a rank's lease expired, it left, or it was restarted
    FAILED = "failed"  # an action failed
    TIMEOUT = "timeout"  # a barrier passed its deadline
    INTERNAL = "internal"  # the master hit an unexpected error
    USAGE = "usage"  # a setting cannot work (checked before any work): no retry cures it

    @property
    def exit_code(self) -> ExitCode:
        return {
            AbortKind.LOST: ExitCode.PEER_LOST,
            AbortKind.FAILED: ExitCode.PHASE_FAILED,
            AbortKind.TIMEOUT: ExitCode.TIMEOUT,
            AbortKind.INTERNAL: ExitCode.PHASE_FAILED,
            AbortKind.USAGE: ExitCode.USAGE,
        }[self]


class Decision(str, enum.Enum):
    CONTINUE = "continue"
    ABORT = "abort"


class ArrivalStatus(str, enum.Enum):
    OK = "ok"
    FAILED = "failed"


T = TypeVar("T", bound="Record")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
    """Base of every on-disk record: JSON encoding and strict decoding."""

    SCHEMA: ClassVar[str] = ""

    def to_json(self) -> JsonObject:
        body: JsonObject = {"schema": self.SCHEMA, "version": VERSION}
        for f in dataclasses.fields(self):
            body[f.name] = codec.encode(getattr(self, f.name))
        return body

    def to_bytes(self) -> bytes:
        return (json.dumps(self.to_json(), sort_keys=False, allow_nan=False) + "\n").encode()

    @classmethod
    def from_json(cls: type[T], obj: object, path: Path) -> T:
        if not isinstance(obj, dict):
            raise MalformedRecordError(path, f"expected a JSON object, got {type(obj).__name__}")
        if obj.get("schema") != cls.SCHEMA:
            raise MalformedRecordError(
                path, f"schema is {obj.get('schema')!r}, expected {cls.SCHEMA!r}"
            )
        if obj.get("version") != VERSION:
            raise MalformedRecordError(
                path, f"version {obj.get('version')!r} is not supported (this build reads {VERSION})"
            )
        values = {}
        for name, decode in _fields(cls):  # type: ignore[arg-type]  # classes hash
            if name not in obj:
                raise MalformedRecordError(path, f"field {name!r} is missing")
            values[name] = decode(obj[name], name, path)
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise MalformedRecordError(path, str(exc)) from exc

    @classmethod
    def from_fields(cls: type[T], fields: dict[str, Any], path: Path) -> T:
        """A record nested in another: its fields without schema and version."""
        return cls.from_json({"schema": cls.SCHEMA, "version": VERSION, **fields}, path)

    @classmethod
    def from_bytes(cls: type[T], data: bytes, path: Path) -> T:
        try:
            obj = json.loads(data)
        # ValueError: JSON's own errors, and an integer of more digits than Python
        # converts; RecursionError: arrays or objects nested thousands deep.
        except (ValueError, RecursionError) as exc:
            raise MalformedRecordError(path, f"not valid JSON ({type(exc).__name__}: "
                                       f"{str(exc)[:200]})") from exc
        return cls.from_json(obj, path)


@functools.cache
def _fields(cls: type[Record]) -> tuple[tuple[str, codec.Decoder], ...]:
    """(name, decoder) of a record's fields; resolving type hints is slow, so once per class."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, codec.decoder(hints[f.name])) for f in dataclasses.fields(cls))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest(Record):
    SCHEMA: ClassVar[str] = "coordinator/manifest"
    run_id: str
    generation: int
    num_nodes: int
    weights: tuple[float, ...] | str
    config: dict[str, Any]
    config_hash: str
    created: float

    @property
    def rank_weights(self) -> Weights:
        return "auto" if isinstance(self.weights, str) else self.weights

    def __post_init__(self) -> None:
        check_run_id(self.run_id)  # the only run id that becomes a path (archive/<run_id>)
        check_generation(self.generation)
        if not 1 <= self.num_nodes <= MAX_RANKS:
            raise ValueError(f"num_nodes {self.num_nodes} is outside 1..{MAX_RANKS}")
        if isinstance(self.weights, tuple) and (
                len(self.weights) != self.num_nodes
                or not all(math.isfinite(w) for w in self.weights)):
            raise ValueError(f"weights {list(self.weights)} must be {self.num_nodes} finite "
                             "numbers, one per node")
        if isinstance(self.weights, str) and self.weights != "auto":
            raise ValueError(f"weights {self.weights!r} must be a list of numbers or 'auto'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Claim(Record):
    SCHEMA: ClassVar[str] = "coordinator/claim"
    run_id: str
    generation: int
    rank: int
    token: str
    host: str
    address: str
    probe_port: int | None
    pid: int
    started: float

    def __post_init__(self) -> None:
        check_generation(self.generation)
        check_rank(self.rank)
        check_pid(self.pid)
        if self.probe_port is not None and not 0 < self.probe_port < 65536:
            raise ValueError(f"probe_port {self.probe_port} is outside 1..65535")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Abort(Record):
    SCHEMA: ClassVar[str] = "coordinator/abort"
    kind: AbortKind
    reason: str
    rank: int | None
    iteration: int | None
    phase: int | None

    def __post_init__(self) -> None:
        if self.rank is not None and self.rank != -1:  # -1: no single rank to blame
            check_rank(self.rank)
        if self.iteration is not None:
            check_iteration(self.iteration)
        if self.phase is not None:
            check_phase(self.phase)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Heartbeat(Record):
    SCHEMA: ClassVar[str] = "coordinator/heartbeat"
    run_id: str
    generation: int
    rank: int
    token: str
    host: str
    pid: int
    counter: int
    state: NodeState
    iteration: int
    phase: int
    waiting_for: str
    arrived: tuple[int, int] | None
    released: tuple[int, int] | None
    session: str | None
    resume_iteration: int
    abort: Abort | None
    error: str | None
    wall_time: float
    # With a failed state: the signature of this rank's own failed step
    # (errors.fault_signature), "" when its failure is not a step's own.
    fault: str = ""

    def __post_init__(self) -> None:
        check_generation(self.generation)
        check_rank(self.rank)
        check_pid(self.pid)
        check_iteration(self.iteration)
        check_phase(self.phase)
        check_iteration(self.resume_iteration)
        check_point(self.arrived, "arrived")
        check_point(self.released, "released")
        if self.counter < 0:
            raise ValueError(f"counter {self.counter} is negative")


# A refusal's message, as its master keeps it: a usage error is a line or
# two; the bound keeps a hostile or runaway one from filling a worker's terminal.
MAX_REFUSAL_CHARS: Final = 4000


@dataclasses.dataclass(frozen=True, kw_only=True)
class Refusal(Record):
    """A master refused its own command line at start (coordinator/machine/refusal.py)."""

    SCHEMA: ClassVar[str] = "coordinator/refusal"
    token: str  # random, new at every refusal: a worker tells a new one from the one it saw
    host: str
    pid: int
    wall_time: float  # the master's wall clock when it refused
    message: str

    def __post_init__(self) -> None:
        check_pid(self.pid)
        if not 0 < len(self.token) <= 64:
            raise ValueError(f"token of {len(self.token)} characters is not 1..64")
        if len(self.host) > 255:
            raise ValueError(f"host of {len(self.host)} characters is above 255")
        if len(self.message) > MAX_REFUSAL_CHARS:
            raise ValueError(f"message of {len(self.message)} characters is above "
                             f"{MAX_REFUSAL_CHARS}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Session(Record):
    SCHEMA: ClassVar[str] = "coordinator/session"
    run_id: str
    generation: int
    session: str
    start_iteration: int
    end_iteration: int
    members: dict[str, str]

    def __post_init__(self) -> None:
        check_generation(self.generation)
        check_iteration(self.start_iteration)
        if not self.start_iteration <= self.end_iteration <= MAX_ITERATIONS:
            raise ValueError(
                f"end_iteration {self.end_iteration} is outside {self.start_iteration}.."
                f"{MAX_ITERATIONS}"
            )
        for rank in self.members:
            if not rank.isdigit():
                raise ValueError(f"members key {rank!r} is not a rank")
            check_rank(int(rank))

    def token_of(self, rank: int) -> str | None:
        return self.members.get(str(rank))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Arrival(Record):
    SCHEMA: ClassVar[str] = "coordinator/arrival"
    run_id: str
    generation: int
    session: str
    rank: int
    token: str
    iteration: int
    phase: int
    status: ArrivalStatus
    error: str | None
    done: tuple[int, ...]
    payload: dict[str, Any]

    def __post_init__(self) -> None:
        check_generation(self.generation)
        check_rank(self.rank)
        check_iteration(self.iteration)
        check_phase(self.phase)
        for phase in self.done:
            check_phase(phase)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Release(Record):
    SCHEMA: ClassVar[str] = "coordinator/release"
    run_id: str
    generation: int
    session: str
    iteration: int
    phase: int
    decision: Decision
    abort: Abort | None
    payload: dict[str, Any]

    def __post_init__(self) -> None:
        check_iteration(self.iteration)
        check_phase(self.phase)
        if (self.decision is Decision.ABORT) != (self.abort is not None):
            raise ValueError("a release carries an abort exactly when its decision is 'abort'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Journal(Record):
    SCHEMA: ClassVar[str] = "coordinator/journal"
    run_id: str
    rank: int
    completed_iteration: int
    iteration: int
    done: tuple[int, ...]

    def __post_init__(self) -> None:
        check_rank(self.rank)
        if not -1 <= self.completed_iteration < MAX_ITERATIONS:
            raise ValueError(
                f"completed_iteration {self.completed_iteration} is outside -1..{MAX_ITERATIONS - 1}")
        check_iteration(self.iteration)
        for phase in self.done:
            check_phase(phase)

    def is_done(self, iteration: int, phase: int) -> bool:
        if iteration <= self.completed_iteration:
            return True
        return iteration == self.iteration and phase in self.done

    def with_done(self, iteration: int, phase: int) -> Journal:
        if iteration <= self.completed_iteration:
            # A replayed iteration (the group resumed behind this rank, and a
            # collective or rerun phase ran again): it is complete already, and
            # what this rank has done of a later iteration stays.
            return self
        done = self.done if iteration == self.iteration else ()
        return dataclasses.replace(
            self, iteration=iteration, done=tuple(sorted({*done, phase}))
        )

    def with_completed(self, iteration: int) -> Journal:
        if iteration <= self.completed_iteration:
            # A replayed iteration (the group resumed behind this rank): the
            # progress it has made on later iterations stays.
            return self
        return dataclasses.replace(
            self, completed_iteration=iteration, iteration=iteration + 1, done=(),
        )

    @property
    def resume_iteration(self) -> int:
        return self.completed_iteration + 1
