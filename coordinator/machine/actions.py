"""The interface between the phase machine and the work done in each phase.

The daemon calls `run(phase, ctx)` on every rank in every phase (an action
with nothing to do returns `{}`), publishes the returned payload in the
rank's arrival, and on the master calls `decide(phase, ctx, arrivals)` once
every rank has arrived; what `decide` returns goes into the release every
rank receives.  Actions must be idempotent per (iteration, phase, rank): the
journal skips completed ones on resume, but a rank killed mid-action runs it
again.  A long action calls `ctx.check_cancel()` now and then, and registers
its child processes with `ctx.add_child`, so that a lost peer stops it fast.

Two implementations ship in rl/, each registered as an entry point of the
group `coordinator.actions`: `scripted` (rl/scripted.py: writes marker files,
sleeps, fails on request, simulates the loop's schedule; used by tests,
benchmarks and as a cluster smoke test) and `rl` (the real loop).  A kind may
add [run] keys of its own (`run_section`) and check a new run's shape
(`check_run`): both kinds add the placement (rl/placement.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Final, Protocol

from coordinator.config.run_config import RunConfig, RunSection
from coordinator.errors import PhaseFailedError, UsageError
from coordinator.machine.runtime import Runtime
from coordinator.records.phases import Phase
from coordinator.records.records import Arrival, Weights


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
    weights: Weights
    host: str
    address: str
    runtime: Runtime
    # The ranks of the current session, when the group went on without some
    # (coordination.on_failure "shrink"); None: every rank of the run.
    members: tuple[int, ...] | None = None
    # Release payloads of the phases already passed in this iteration.
    releases: dict[int, Mapping[str, Any]] = field(default_factory=dict)
    # This rank's timings of those phases ("action_s", "wait_s": PROTOCOL.md, timings).
    timings: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("coordinator.action"))

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def active_ranks(self) -> tuple[int, ...]:
        """The ranks working in this session, in order (all of them unless shrunk)."""
        return self.members if self.members is not None else tuple(range(self.num_nodes))

    def check_cancel(self) -> None:
        self.runtime.check_cancel()

    def add_child(self, pid: int, what: str) -> None:
        self.runtime.add_child(pid, what)

    def remove_child(self, pid: int) -> None:
        self.runtime.remove_child(pid)

    def release(self, phase: Phase) -> Mapping[str, Any]:
        """The payload of an earlier phase's release in this iteration."""
        return self.releases.get(int(phase), {})


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """What a completed run did, in the action kind's words, and why it did not
    achieve what it was asked (None: it did).  A run with a problem exits 4."""

    text: str  # e.g. "2048 samples trained, 0 failed"
    problem: str | None = None


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
    """An implementation of the actions, as a package registers it.

    Packages register a kind under the entry-point group `coordinator.actions`
    (pyproject.toml), the way pytest finds its plugins: this package never
    names them, and a user's own package can add one.
    """

    name: str
    # (config, *, rank, num_nodes, run_dir) -> Actions
    build: Callable[..., Actions]
    # raw config sections -> the resolved sections, every default filled in
    resolve_sections: Callable[[Mapping[str, Any]], Mapping[str, Any]]
    # dotted keys that belong to each node, never to run.json (PROTOCOL.md)
    node_local: tuple[str, ...] = ()
    # (run dir, config) -> RunSummary: each daemon's last line once every
    # iteration completed, and whether the run may exit 0
    summarize: Callable[[Path, RunConfig], RunSummary] | None = None
    # (run dir, iterations) -> one row per iteration (column -> value) for
    # `coordinator status`, which adds each iteration's recoveries
    iteration_report: Callable[[Path, int], list[dict[str, Any]]] | None = None
    # config -> the phases every iteration runs, in order (the rl kind can run
    # one half of the loop); None: all of them.  The phase machine asks here
    # and never reads the kind's own settings.
    phases: Callable[[RunConfig], tuple[Phase, ...]] | None = None
    # Whether every file its actions write and read goes through coordinator/fsio
    # (so a bucket run directory can carry it: coordinator/storage/objstore.py).  A kind
    # that writes files by other means is refused on a bucket at start.
    runs_on_buckets: bool = False
    # The kind's [run] keys: RunSection, or a subclass adding its own (the rl
    # kind's placement of roles on nodes, rl/placement.py)
    run_section: type[RunSection] = RunSection
    # (config, num_nodes, weights) -> None, or UsageError: the kind's own checks
    # of a new or resumed run's shape (the rl kind: its placement against the
    # node count, the GPUs and the rank weights), made by the master before
    # run.json is written (coordinator/machine/runplan.py)
    check_run: Callable[[RunConfig, int, Weights], None] | None = None
    # Names at the top of the run directory that the kind's actions write and that
    # belong to one run (the rl kind's training state and TensorBoard events):
    # `run --master --new-run` archives them with the run's own records
    run_outputs: tuple[str, ...] = ()

    def phases_of(self, config: RunConfig) -> tuple[Phase, ...]:
        return tuple(Phase) if self.phases is None else self.phases(config)


def completed_run(action_kind: ActionKind, run_dir: Path, config: RunConfig, *, run_id: str,
                  recoveries: int, last_phase: Phase) -> str:
    """Every iteration completed: what the run did (the action kind's summary and the
    recoveries), each daemon's last line.  A run that did not achieve what it was
    asked (the RL loop: an iteration that trained on nothing or past the failure
    budget) raises PhaseFailedError: exit 4, not 0."""
    iterations = config.run.iterations
    summary = action_kind.summarize(run_dir, config) if action_kind.summarize else None
    if summary is not None and summary.problem:
        raise PhaseFailedError(
            f"every iteration of run {run_id} completed, but not as asked: {summary.problem} "
            f"({summary.text}, {recoveries} recoveries); the run did not learn: find the "
            "cause in the iterations' metrics and logs", rank=None,
            iteration=max(iterations - 1, 0), phase=int(last_phase), cause=summary.problem)
    return (f"{iterations} iterations of run {run_id}: "
            + (f"{summary.text}, " if summary is not None else "") + f"{recoveries} recoveries")


ENTRY_POINT_GROUP: Final = "coordinator.actions"


def kind_names() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))


@functools.cache
def kind(name: str) -> ActionKind:
    """The registered kind `name`; only that one's package is imported."""
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        known = ", ".join(kind_names()) or "none (is the package installed? pip install -e .)"
        raise UsageError(f"run.actions={name!r} is unknown: use one of {known}")
    loaded = found[0].load()
    if not isinstance(loaded, ActionKind) or loaded.name != name:
        raise UsageError(
            f"entry point {found[0].value!r} of group {ENTRY_POINT_GROUP} (run.actions={name!r}) "
            "is not an ActionKind of that name: fix the package that registers it")
    return loaded


def kind_of(raw: Mapping[str, Any]) -> ActionKind:
    """The action kind a raw (or resolved) config names in run.actions."""
    run = raw.get("run", {})
    name = run.get("actions") if isinstance(run, Mapping) else None
    return kind(str(RunSection.actions if name is None else name))


def resolve_config(raw: Mapping[str, Any]) -> RunConfig:
    """Parse a raw config dict (its [run] keys: those of the kind run.actions names)
    and fill every section's defaults."""
    action_kind = kind_of(raw)
    config = RunConfig.from_dict(raw, action_kind.run_section)
    sections = dict(action_kind.resolve_sections(config.sections))
    return RunConfig(run=config.run, coordination=config.coordination, sections=sections,
                     node_local=action_kind.node_local)


def node_local_keys(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """The node-local keys of the action kind a raw (or resolved) config names."""
    return kind_of(raw).node_local
