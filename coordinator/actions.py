"""The interface between the phase machine and the work done in each phase.

The daemon calls `run(phase, ctx)` on every rank in every phase (an action
with nothing to do returns `{}`), publishes the returned payload in the
rank's arrival, and on the master calls `decide(phase, ctx, arrivals)` once
every rank has arrived; what `decide` returns goes into the release every
rank receives.  Actions must be idempotent per (iteration, phase, rank): the
journal skips completed ones on resume, but a rank killed mid-action runs it
again.  A long action calls `ctx.check_cancel()` now and then, and registers
its child processes with `ctx.add_child`, so that a lost peer stops it fast.

Two implementations ship: `scripted` (coordinator/scripted.py: writes marker
files, sleeps, fails on request; used by tests, benchmarks and as a cluster
smoke test) and `rl` (rollout/ and trainer/: the real loop).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from coordinator.config import RunConfig
from coordinator.errors import UsageError
from coordinator.phases import Phase
from coordinator.records import Arrival
from coordinator.runtime import Runtime


@dataclass(kw_only=True)
class StepContext:
    """What an action may know and use; one per phase call."""

    rank: int
    num_nodes: int
    iteration: int
    phase: Phase
    run_dir: Path
    run_id: str
    config: RunConfig
    weights: tuple[float, ...] | str
    host: str
    address: str
    runtime: Runtime
    # Release payloads of the phases already passed in this iteration.
    releases: dict[int, Mapping[str, Any]] = field(default_factory=dict)
    # Master, phases 9-10: the training port's listening socket, held since it
    # was announced; the rendezvous store takes it over (trainer/rendezvous.py).
    listener: Any = None
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("coordinator.action"))

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def check_cancel(self) -> None:
        self.runtime.check_cancel()

    def add_child(self, pid: int, what: str) -> None:
        self.runtime.add_child(pid, what)

    def remove_child(self, pid: int) -> None:
        self.runtime.remove_child(pid)

    def release(self, phase: Phase) -> Mapping[str, Any]:
        """The payload of an earlier phase's release in this iteration."""
        return self.releases.get(int(phase), {})


class Actions(Protocol):
    def run(self, phase: Phase, ctx: StepContext) -> Mapping[str, Any]:
        """Do this rank's work for the phase; raise to fail the phase."""
        ...

    def decide(
        self, phase: Phase, ctx: StepContext, arrivals: Mapping[int, Arrival]
    ) -> Mapping[str, Any]:
        """Master only, after every rank arrived: extra release payload."""
        ...

    def partial_outputs(self, iteration: int, phase: Phase, rank: int) -> list[Path]:
        """Outputs `recover` removes when the journal says the action did not complete.

        Resumable outputs (rollout checkpoints) are left out on purpose.
        """
        ...

    def close(self) -> None:
        """Stop engines and children at exit; must not raise."""
        ...


@dataclass(frozen=True, kw_only=True)
class ActionKind:
    """A registered implementation: how to validate its config and build it."""

    name: str
    target: str  # "module:function" building Actions(config, rank, num_nodes, run_dir)
    sections: str  # "module:function" resolving raw config sections into defaults
    node_local: str = ""  # "module:NAME" of its node-local dotted keys (PROTOCOL.md)

    def _load(self, spec: str) -> Callable[..., Any]:
        module, _, attr = spec.partition(":")
        return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]

    def resolve_sections(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        return dict(self._load(self.sections)(raw))

    def node_local_keys(self) -> tuple[str, ...]:
        if not self.node_local:
            return ()
        return tuple(self._load(self.node_local))  # type: ignore[arg-type]

    def build(self, config: RunConfig, *, rank: int, num_nodes: int, run_dir: Path) -> Actions:
        return self._load(self.target)(config, rank=rank, num_nodes=num_nodes, run_dir=run_dir)  # type: ignore[no-any-return]


KINDS: dict[str, ActionKind] = {
    "scripted": ActionKind(name="scripted", target="coordinator.scripted:build",
                           sections="coordinator.scripted:resolve_sections"),
    "rl": ActionKind(name="rl", target="rollout.rl_actions:build",
                     sections="rollout.rl_actions:resolve_sections",
                     node_local="rollout.rl_config:NODE_LOCAL_KEYS"),
}


def kind(name: str) -> ActionKind:
    try:
        return KINDS[name]
    except KeyError:
        raise UsageError(
            f"run.actions={name!r} is unknown: use one of {', '.join(sorted(KINDS))}"
        ) from None


def resolve_config(raw: Mapping[str, Any]) -> RunConfig:
    """Parse a raw config dict and fill every section's defaults."""
    config = RunConfig.from_dict(raw)
    action_kind = kind(config.run.actions)
    sections = action_kind.resolve_sections(config.sections)
    return RunConfig(run=config.run, coordination=config.coordination, sections=sections,
                     node_local=action_kind.node_local_keys())


def node_local_keys(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """The node-local keys of the action kind a raw (or resolved) config names."""
    run = raw.get("run", {})
    name = run.get("actions", "rl") if isinstance(run, Mapping) else "rl"
    return kind(str(name)).node_local_keys()
