"""Run configuration: one file (TOML or YAML), defaults that run the demo.

The configuration is a tree of frozen, keyword-only dataclasses whose fields
are declared once (coordinator/config/settings.py: type, default, bounds, unit, help)
and checked on construction.  `from_mapping` builds one from a parsed file
strictly: an unknown key or a mistyped value is an error naming the key, the
value and the fix (for a key, the closest setting: "did you mean ...?").  The
master writes the resolved tree (every default filled in) into the run
manifest; workers read it from there.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Final

from coordinator.config import on_failure
from coordinator.config.on_failure import OnFailure
from coordinator.config.settings import (  # noqa: F401  (re-exported: the names config users import)
    CLOSE_ENOUGH,
    Section,
    SettingError,
    UnknownSettingError,
    closest_name,
    from_mapping,
    setting,
    subsection,
    unknown_setting,
)
from coordinator.errors import UsageError
from coordinator.records.bounds import MAX_RANKS
from coordinator.records.phases import TimeoutKey

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# recoveries.json keeps every recovery of a run: this bounds its size.
MAX_RECOVERIES: Final = 1000


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseTimeouts(Section):
    """Barrier deadlines per kind of phase, in seconds (see PROTOCOL.md)."""

    SECTION: ClassVar[str] = "coordination.phase_timeouts_s"

    sync: float = setting(600.0, "Barrier deadline of phases 0, 3, 5, 9, 13.", unit="s", gt=0)
    rollout: float = setting(21600.0, "Phases 1, 2, 6 (a whole rollout).", unit="s", gt=0)
    aggregate: float = setting(3600.0, "Phases 4, 8, 11.", unit="s", gt=0)
    engine: float = setting(1800.0, "Phases 7, 12 (engine stop / start).", unit="s", gt=0)
    train: float = setting(43200.0, "Phase 10.", unit="s", gt=0)

    def of(self, key: TimeoutKey) -> float:
        return float(getattr(self, key.value))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinationConfig(Section):
    """Heartbeats, leases, polling and deadlines (all operational)."""

    SECTION: ClassVar[str] = "coordination"

    heartbeat_interval_s: float = setting(
        2.0, "Between two heartbeat publishes.", unit="s", gt=0, flag="--heartbeat-interval")
    lease_s: float = setting(
        15.0, "A rank whose heartbeat has not advanced this long is lost.", unit="s", gt=0,
        flag="--lease")
    poll_initial_s: float = setting(0.002, "First poll interval of a wait.", unit="s", gt=0)
    poll_factor: float = setting(1.5, "Growth of the poll interval.", ge=1,
                                 fix="polls would speed up forever; use 1.5")
    poll_ceiling_s: float = setting(1.0, "Largest poll interval.", unit="s", gt=0)
    progress_interval_s: float = setting(
        10.0, "A waiting daemon logs what it waits for at most this often.", unit="s", gt=0)
    join_timeout_s: float = setting(
        1800.0, "Waiting for the master, for every rank to join, for the session.", unit="s",
        gt=0)
    cancel_grace_s: float = setting(
        2.0, "A cancelled action gets this long before the daemon exits anyway.", unit="s",
        gt=0)
    read_retry_s: float = setting(
        5.0, "Retrying a torn, stale (ESTALE) or unreadable record, and every other shared "
        "file the daemon's process reads (rank manifests, shard plans, chunks, checkpoints).",
        unit="s", gt=0)
    probe_timeout_s: float = setting(
        5.0, "One TCP connect to the master's probe port.", unit="s", gt=0)
    # inotify wake-ups on a local filesystem (a hint: NFS never delivers them).
    wakeups: bool = setting(
        True, "Let inotify events cut a local poll short (never needed for correctness).")
    on_failure: OnFailure = setting(OnFailure.WAIT, on_failure.cli_help(), flag="--on-failure")
    max_recoveries: int = setting(
        10, "Automatic recoveries per run (recoveries.json) before every daemon exits as "
        "with `exit`.", ge=0, le=MAX_RECOVERIES, flag="--max-recoveries")
    # A step that fails the same way again will meet the same cause again.
    max_attempts: int = setting(
        2, "One step (a phase of an iteration) failing the same way this many times stops "
        "the run with exit 4, under every `on_failure` (lost ranks do not count).",
        ge=1, le=MAX_RECOVERIES)
    rejoin_timeout_s: float = setting(
        1800.0, "How long a regrouping group waits for a missing rank (or a restarted "
        "master).", unit="s", gt=0)
    shrink_after_s: float = setting(
        300.0, "With `shrink`: how long the master waits for a missing worker before going "
        "on without it.", unit="s", gt=0)
    min_nodes: int = setting(
        1, "With `shrink`: the fewest nodes, the master included, a group may go on with; "
        "fewer and every daemon exits 3.", ge=1, le=MAX_RANKS, flag="--min-nodes")
    phase_timeouts_s: PhaseTimeouts = subsection(
        PhaseTimeouts, "Barrier deadlines per kind of phase.")

    def check(self) -> None:
        if self.heartbeat_interval_s >= self.lease_s:
            raise SettingError(
                f"coordination.heartbeat_interval_s={self.heartbeat_interval_s} must be below "
                f"coordination.lease_s={self.lease_s}: a peer must get several heartbeats into "
                "one lease; e.g. heartbeat 2 s, lease 15 s", key="coordination.lease_s",
                value=self.lease_s)
        if self.poll_initial_s > self.poll_ceiling_s:
            raise SettingError(
                f"coordination.poll_initial_s={self.poll_initial_s} exceeds "
                f"poll_ceiling_s={self.poll_ceiling_s}: the first poll cannot be the slowest",
                key="coordination.poll_initial_s", value=self.poll_initial_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSection(Section):
    """What the run does; `iterations` and `progress` are operational.  An action
    kind may declare `[run]` keys of its own in a subclass (ActionKind.run_section:
    the rl kind's placement, rl/placement.py)."""

    SECTION: ClassVar[str] = "run"

    iterations: int = setting(8, "RL iterations to run.", ge=1, le=999_999,
                              flag="--iterations")
    seed: int = setting(0, "Run seed.", ge=0, flag="--seed")
    actions: str = setting(
        "rl", "The action kind (an entry point of coordinator.actions): rl, or scripted "
        "(no ML; a smoke test of the shared filesystem).", flag="--actions")
    progress: bool = setting(True, "Read by nothing: kept so that configs that give it still parse.")


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
    def from_dict(cls, raw: Mapping[str, Any],
                  run_section: type[RunSection] = RunSection) -> RunConfig:
        """`run_section`: the action kind's [run] keys (ActionKind.run_section)."""
        raw = dict(raw)
        run = from_mapping(run_section, raw.pop("run", {}), "run")
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
