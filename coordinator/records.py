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
import typing
from pathlib import Path
from typing import Any, ClassVar, Final, TypeVar

from coordinator import codec
from coordinator.errors import ExitCode, MalformedRecordError

VERSION: Final = 1
MAX_RANKS: Final = 4096
MAX_ITERATIONS: Final = 1_000_000
NUM_PHASES: Final = 14
JsonObject = dict[str, Any]


class NodeState(str, enum.Enum):
    """A daemon's lifecycle, as its heartbeat reports it.

    starting -> running <-> waiting -> finished
                   \\-> failed | left   (from any state)
    """

    STARTING = "starting"
    RUNNING = "running"
    WAITING = "waiting"
    FINISHED = "finished"
    LEFT = "left"
    FAILED = "failed"


class AbortKind(str, enum.Enum):
    """Why the master stopped the group; decides every daemon's exit code."""

    LOST = "lost"  # a rank's lease expired, it left, or it was restarted
    FAILED = "failed"  # an action failed
    TIMEOUT = "timeout"  # a barrier passed its deadline
    INTERNAL = "internal"  # the master hit an unexpected error

    @property
    def exit_code(self) -> ExitCode:
        return {
            AbortKind.LOST: ExitCode.PEER_LOST,
            AbortKind.FAILED: ExitCode.PHASE_FAILED,
            AbortKind.TIMEOUT: ExitCode.TIMEOUT,
            AbortKind.INTERNAL: ExitCode.PHASE_FAILED,
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
        for name, decode in _fields(cls):
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
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MalformedRecordError(path, f"not valid JSON ({exc})") from exc
        return cls.from_json(obj, path)


@functools.cache
def _fields(cls: type[Record]) -> tuple[tuple[str, codec.Decoder], ...]:
    """(name, decoder) of a record's fields; resolving type hints is slow, so once per class."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, codec.decoder(hints[f.name])) for f in dataclasses.fields(cls))


def check_rank(rank: int, num_nodes: int = MAX_RANKS) -> int:
    if not 0 <= rank < min(num_nodes, MAX_RANKS):
        raise ValueError(f"rank {rank} is outside 0..{min(num_nodes, MAX_RANKS) - 1}")
    return rank


def check_iteration(iteration: int) -> int:
    if not 0 <= iteration < MAX_ITERATIONS:
        raise ValueError(f"iteration {iteration} is outside 0..{MAX_ITERATIONS - 1}")
    return iteration


def check_phase(phase: int) -> int:
    if not 0 <= phase < NUM_PHASES:
        raise ValueError(f"phase {phase} is outside 0..{NUM_PHASES - 1}")
    return phase


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

    def __post_init__(self) -> None:
        if not 1 <= self.num_nodes <= MAX_RANKS:
            raise ValueError(f"num_nodes {self.num_nodes} is outside 1..{MAX_RANKS}")
        if self.generation < 0:
            raise ValueError(f"generation {self.generation} is negative")
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
        check_rank(self.rank)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Abort(Record):
    SCHEMA: ClassVar[str] = "coordinator/abort"
    kind: AbortKind
    reason: str
    rank: int | None
    iteration: int | None
    phase: int | None


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

    def __post_init__(self) -> None:
        check_rank(self.rank)


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
        check_iteration(self.start_iteration)
        if self.end_iteration < self.start_iteration:
            raise ValueError(
                f"end_iteration {self.end_iteration} < start_iteration {self.start_iteration}"
            )

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
        check_rank(self.rank)
        check_iteration(self.iteration)
        check_phase(self.phase)


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
        if self.completed_iteration < -1:
            raise ValueError(f"completed_iteration {self.completed_iteration} is below -1")
        for phase in self.done:
            check_phase(phase)

    def is_done(self, iteration: int, phase: int) -> bool:
        if iteration <= self.completed_iteration:
            return True
        return iteration == self.iteration and phase in self.done

    def with_done(self, iteration: int, phase: int) -> Journal:
        done = self.done if iteration == self.iteration else ()
        return dataclasses.replace(
            self, iteration=iteration, done=tuple(sorted({*done, phase}))
        )

    def with_completed(self, iteration: int) -> Journal:
        return dataclasses.replace(
            self, completed_iteration=max(iteration, self.completed_iteration),
            iteration=iteration + 1, done=(),
        )

    @property
    def resume_iteration(self) -> int:
        return self.completed_iteration + 1
