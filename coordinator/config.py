"""Run configuration: one file (TOML or YAML), defaults that run the demo.

The configuration is a tree of frozen, keyword-only dataclasses, each
validated in `__post_init__`.  `from_mapping` builds one from a parsed file
strictly: an unknown key or a mistyped value is an error naming the key, the
value and the fix (for a key, the closest setting: "did you mean ...?").  The master writes the resolved tree (every default filled
in) into the run manifest; workers read it from there.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import hashlib
import json
import math
import sys
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Final, TypeVar, Union

from coordinator.errors import UsageError
from coordinator.on_failure import OnFailure
from coordinator.phases import TimeoutKey
from coordinator.placement import Placement
from coordinator.records import MAX_RANKS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

T = TypeVar("T")
# recoveries.json keeps every recovery of a run: this bounds its size.
MAX_RECOVERIES: Final = 1000
# How alike (difflib's ratio) a mistyped name and a setting must be to offer
# the setting: 0.6 catches a letter dropped, doubled or swapped (lrr -> lr,
# leese_s -> lease_s) without offering an unrelated name.
CLOSE_ENOUGH: Final = 0.6


class UnknownSettingError(UsageError):
    """A config file or --set names a key no section has (exit 2 at start)."""

    def __init__(self, message: str, *, key: str, suggestion: str | None) -> None:
        super().__init__(message)
        self.key = key  # dotted, as given: train.lrr
        self.suggestion = suggestion  # dotted, the closest setting: train.lr


def closest_name(name: str, known: Collection[str]) -> str | None:
    """The name of `known` most like `name`, if any is close enough to be a typo of it."""
    found = difflib.get_close_matches(name, list(known), n=1, cutoff=CLOSE_ENOUGH)
    return found[0] if found else None


def unknown_setting(key: str, section: str, known: Collection[str],
                    suggestion: str | None = None) -> UnknownSettingError:
    """The error for dotted `key`, which names no setting of `section` (whose settings
    are `known`): the closest setting (`suggestion`, or the closest of `known`),
    else the list of `known`."""
    if suggestion is None:
        near = closest_name(key.rpartition(".")[2], known)
        suggestion = f"{section}.{near}" if near else None
    if suggestion:
        return UnknownSettingError(f"{key}: no such setting; did you mean {suggestion}?",
                                   key=key, suggestion=suggestion)
    return UnknownSettingError(
        f"{key}: no such setting; the settings of [{section}] are {', '.join(sorted(known))}",
        key=key, suggestion=None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseTimeouts:
    """Barrier deadlines per kind of phase, in seconds (see PROTOCOL.md)."""

    sync: float = 600.0
    rollout: float = 21600.0
    aggregate: float = 3600.0
    engine: float = 1800.0
    train: float = 43200.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _positive(f"coordination.phase_timeouts_s.{f.name}", getattr(self, f.name))

    def of(self, key: TimeoutKey) -> float:
        return float(getattr(self, key.value))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinationConfig:
    """Heartbeats, leases, polling and deadlines (all operational)."""

    heartbeat_interval_s: float = 2.0
    lease_s: float = 15.0
    poll_initial_s: float = 0.002
    poll_factor: float = 1.5
    poll_ceiling_s: float = 1.0
    progress_interval_s: float = 10.0
    join_timeout_s: float = 1800.0
    cancel_grace_s: float = 2.0
    read_retry_s: float = 5.0
    probe_timeout_s: float = 5.0
    # inotify wake-ups on a local filesystem (a hint: NFS never delivers them).
    wakeups: bool = True
    on_failure: OnFailure = OnFailure.WAIT  # coordinator/on_failure.py: the policies
    max_recoveries: int = 10  # per run, counted in recoveries.json
    # A step (one phase of one iteration) that fails the same way this many
    # times stops the run with exit 4 under every on_failure: a retry that met
    # the same cause again will meet it again.  Lost ranks are not counted.
    max_attempts: int = 2
    rejoin_timeout_s: float = 1800.0
    # on_failure "shrink": how long to wait for a missing worker before going on
    # without it, and the fewest nodes (the master included) to go on with.
    shrink_after_s: float = 300.0
    min_nodes: int = 1
    phase_timeouts_s: PhaseTimeouts = dataclasses.field(default_factory=PhaseTimeouts)

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_s", "lease_s", "poll_initial_s", "poll_ceiling_s",
                     "progress_interval_s", "join_timeout_s", "cancel_grace_s",
                     "read_retry_s", "probe_timeout_s", "rejoin_timeout_s", "shrink_after_s"):
            _positive(f"coordination.{name}", getattr(self, name))
        if not 0 <= self.max_recoveries <= MAX_RECOVERIES:
            raise UsageError(
                f"coordination.max_recoveries={self.max_recoveries} is outside "
                f"0..{MAX_RECOVERIES}: give how many automatic recoveries a run may make "
                "before every node exits, e.g. --max-recoveries 10")
        if not 1 <= self.max_attempts <= MAX_RECOVERIES:
            raise UsageError(
                f"coordination.max_attempts={self.max_attempts} is outside "
                f"1..{MAX_RECOVERIES}: give how many times one step may fail the same way "
                "before the run stops, e.g. 2 (1: never retry a failed step)")
        if not 1 <= self.min_nodes <= MAX_RANKS:
            raise UsageError(
                f"coordination.min_nodes={self.min_nodes} is outside 1..{MAX_RANKS}: give the "
                "fewest nodes, the master included, a shrunk group may go on with, e.g. "
                "--min-nodes 2")
        if self.heartbeat_interval_s >= self.lease_s:
            raise UsageError(
                f"coordination.heartbeat_interval_s={self.heartbeat_interval_s} must be below "
                f"coordination.lease_s={self.lease_s}: a peer must get several heartbeats into "
                "one lease; e.g. heartbeat 2 s, lease 15 s"
            )
        if self.poll_factor < 1.0:
            raise UsageError(
                f"coordination.poll_factor={self.poll_factor} is below 1: polls would speed up "
                "forever; use 1.5"
            )
        if self.poll_initial_s > self.poll_ceiling_s:
            raise UsageError(
                f"coordination.poll_initial_s={self.poll_initial_s} exceeds "
                f"poll_ceiling_s={self.poll_ceiling_s}: the first poll cannot be the slowest"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSection:
    """What the run does; `iterations` and `progress` are operational."""

    iterations: int = 8
    seed: int = 0
    actions: str = "rl"
    progress: bool = True
    # Placement and asynchrony (coordinator/placement.py): which nodes roll out
    # and which train ("" and "": every node does both), and how many policy
    # versions a sample may lag (0: the synchronous loop).  A single node may be
    # given as a number (--set run.train_nodes=0).
    rollout_nodes: str | int = ""
    train_nodes: str | int = ""
    max_off_policy_steps: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.iterations < 1_000_000:
            raise UsageError(
                f"run.iterations={self.iterations} is outside 1..999999: give the number of "
                "RL iterations to run, e.g. --iterations 8"
            )

    def placement(self, num_nodes: int) -> Placement:
        """The run's placement, checked against the node count (UsageError)."""
        return Placement.of(rollout_nodes=str(self.rollout_nodes),
                            train_nodes=str(self.train_nodes),
                            max_off_policy_steps=self.max_off_policy_steps, num_nodes=num_nodes)


# Keys an operator may change on a restart without changing the experiment.
OPERATIONAL_KEYS: Final = ("coordination", "run.iterations", "run.progress")


def drop_keys(tree: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """A deep copy of `tree` without the dotted `keys` (a key names a value or a section)."""
    out: dict[str, Any] = json.loads(json.dumps(tree))
    for key in keys:
        *parents, last = key.split(".")
        node: Any = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return out


def pick_keys(tree: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """Only the dotted `keys` of `tree` that it has, in the same nesting."""
    out: dict[str, Any] = {}
    for key in keys:
        *parents, last = key.split(".")
        node: Any = tree
        for part in parents:
            node = node.get(part) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping) and last in node:
            target = out
            for part in parents:
                target = target.setdefault(part, {})
            target[last] = node[last]
    return out


def is_under(key: str, prefixes: tuple[str, ...]) -> bool:
    """Whether dotted `key` is one of `prefixes` or inside one of them."""
    return any(key == p or key.startswith(p + ".") for p in prefixes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The whole configuration; sections beyond run/coordination belong to actions."""

    run: RunSection = dataclasses.field(default_factory=RunSection)
    coordination: CoordinationConfig = dataclasses.field(default_factory=CoordinationConfig)
    sections: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Dotted keys that belong to each node, never to the run (PROTOCOL.md,
    # node-local keys): executables, environment, extra arguments, API keys,
    # local paths.  run.json carries everything else.
    node_local: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = {"run": to_plain(self.run), "coordination": to_plain(self.coordination)}
        out.update({k: to_plain(v) for k, v in self.sections.items()})
        return out

    def experiment(self) -> dict[str, Any]:
        """What run.json records: the whole configuration but the node-local keys."""
        return drop_keys(self.to_dict(), self.node_local)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> RunConfig:
        raw = dict(raw)
        run = from_mapping(RunSection, raw.pop("run", {}), "run")
        coordination = from_mapping(CoordinationConfig, raw.pop("coordination", {}), "coordination")
        return cls(run=run, coordination=coordination, sections=raw)

    def hash(self) -> str:
        return config_hash(self.experiment())


def config_hash(config: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical JSON of the config without its operational keys."""
    pruned = drop_keys(config, OPERATIONAL_KEYS)
    canonical = json.dumps(pruned, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def load_file(path: Path) -> dict[str, Any]:
    """Parse a TOML (.toml) or YAML (.yaml/.yml) config file into a dict."""
    if not path.is_file():
        raise UsageError(f"--config {path} does not exist or is not a file: give a .toml or .yaml file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"--config {path} is not UTF-8 text (byte {exc.start} is 0x{exc.object[exc.start]:02x}):"
            " save it as UTF-8") from None
    except OSError as exc:
        raise UsageError(f"--config {path} cannot be read: {exc.strerror}") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise UsageError(
                f"--config {path} has suffix {path.suffix!r}: use .toml, .yaml or .yml"
            )
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        if isinstance(exc, UsageError):
            raise
        raise UsageError(f"--config {path} cannot be parsed: {exc}") from exc
    except Exception as exc:  # yaml.YAMLError has no common base we import eagerly
        raise UsageError(f"--config {path} cannot be parsed: {exc}") from exc
    if not isinstance(data, dict):
        raise UsageError(f"--config {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise UsageError(f"{name}={value} must be a positive number of seconds")


def to_plain(obj: Any) -> Any:
    """A dataclass tree as JSON-ready builtins (enums by value, tuples as lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def from_mapping(cls: type[T], raw: Any, where: str) -> T:
    """Build dataclass `cls` from a parsed mapping, strictly."""
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, Mapping):
        raise UsageError(f"[{where}] must be a table of keys, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise unknown_setting(f"{where}.{unknown[0]}", where, fields)
    hints = typing.get_type_hints(cls)
    values = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in raw.items()}
    try:
        return cls(**values)
    except UsageError:
        raise
    except (TypeError, ValueError) as exc:
        raise UsageError(f"[{where}]: {exc}") from exc


def _coerce(value: Any, hint: Any, name: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(hint)):
            return None
        last: Exception | None = None
        for arg in args:
            try:
                return _coerce(value, arg, name)
            except UsageError as exc:
                last = exc
        raise last or UsageError(f"{name}={value!r} has the wrong type")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, name)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            allowed = ", ".join(str(m.value) for m in hint)
            raise UsageError(f"{name}={value!r} is not one of: {allowed}") from None
    if hint is bool:
        if not isinstance(value, bool):
            raise UsageError(f"{name}={value!r} must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{name}={value!r} must be an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"{name}={value!r} must be a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise UsageError(f"{name}={value!r} must be a string")
        return value
    if hint is Path:
        if not isinstance(value, (str, Path)):
            raise UsageError(f"{name}={value!r} must be a path string")
        return Path(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise UsageError(f"{name}={value!r} must be a list")
        item = typing.get_args(hint)[0]
        return tuple(_coerce(v, item, name) for v in value)
    return value
