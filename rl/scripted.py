"""Scripted actions: the phase machine with no ML in it.

Used by the tests (files written, sleeps, injected failures), by the
coordination benchmarks (no work at all), and by operators as a smoke test of
a cluster's shared filesystem: `coordinator run ... --actions scripted`.

Config section `[scripted]`; every rule is a string "RANK:ITERATION:PHASE"
(each part a number or `*`), sleeps add ":SECONDS".

    [scripted]
    sleep_s = 0.0                  # every action sleeps this long
    sleeps = ["1:*:4:30"]          # rank 1 sleeps 30 s in phase 4 of every iteration
    fail = ["2:1:6"]               # rank 2 raises in iteration 1, phase 6
    fail_once = ["1:0:4"]          # rank 1 raises the first time it runs it only
    hang = []                      # like sleeps, but ignoring cancellation
    outputs = true                 # write a marker file per executed action
    rollout_s = 0.0                # a simulated train rollout on each rollout node
    train_s = 0.0                  # a simulated training step on each training node

`rollout_s` and `train_s` simulate the RL loop's schedule with the run's
placement (rl/placement.py): a rollout node spends `rollout_s` in
phase 1, or, in an asynchronous run, in phase 10 of the iteration before (the
next iteration's rollout, marked done in
`iterations/<N>/scripted/rank-<R>/rollout.json`, so phase 1 then skips it);
a training node spends `train_s` in phase 10 (a split node, training on some
GPUs and rolling out on others, the longer of the two).  benchmarks/async_bench.py
runs it with GPU-like durations, synchronous against asynchronous.

Each executed action writes `iterations/<N>/scripted/rank-<R>/phase-<KK>.json`
counting how often it ran, and appends (iteration, phase) to
`ranks/<R>/scripted-log.json`, so tests can prove that nothing was redone.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from coordinator.config.run_config import RunConfig, from_mapping, to_plain
from coordinator.config.settings import Section, setting
from coordinator.errors import ActionError, UsageError
from coordinator.machine.actions import ActionKind, StepContext
from coordinator.records import layout
from coordinator.records.phases import Phase
from coordinator.records.records import Arrival, Weights
from coordinator.storage import fsio
from rl import placement
from rl.placement import Placement, RlRunSection, placement_of
from rl.run_layouts import rule_of


def _part(text: str, rule: str) -> int | None:
    if text == "*":
        return None
    try:
        return int(text)
    except ValueError:
        raise UsageError(
            f"scripted rule {rule!r}: {text!r} is neither a number nor '*': "
            "write RANK:ITERATION:PHASE, e.g. 1:*:4"
        ) from None


@dataclass(frozen=True)
class Rule:
    rank: int | None
    iteration: int | None
    phase: int | None
    seconds: float = 0.0

    @classmethod
    def parse(cls, text: str, *, with_seconds: bool) -> Rule:
        parts = text.split(":")
        want = 4 if with_seconds else 3
        if len(parts) != want:
            shape = "RANK:ITERATION:PHASE:SECONDS" if with_seconds else "RANK:ITERATION:PHASE"
            raise UsageError(f"scripted rule {text!r} must look like {shape} ('*' matches any)")
        seconds = 0.0
        if with_seconds:
            try:
                seconds = float(parts[3])
            except ValueError:
                raise UsageError(f"scripted rule {text!r}: {parts[3]!r} is not seconds") from None
        return cls(_part(parts[0], text), _part(parts[1], text), _part(parts[2], text), seconds)

    def matches(self, rank: int, iteration: int, phase: int) -> bool:
        return all(
            want is None or want == got
            for want, got in ((self.rank, rank), (self.iteration, iteration), (self.phase, phase))
        )


@dataclass(frozen=True, kw_only=True)
class ScriptedConfig(Section):
    """The [scripted] section of `run.actions = "scripted"` (see the module docstring)."""

    SECTION: ClassVar[str] = "scripted"

    sleep_s: float = setting(0.0, "Every action sleeps this long.", unit="s", ge=0)
    sleeps: tuple[str, ...] = setting(
        (), "Rules RANK:ITERATION:PHASE:SECONDS ('*' matches any): sleep there, cancellable.")
    fail: tuple[str, ...] = setting((), "Rules RANK:ITERATION:PHASE: raise there, every time.")
    fail_once: tuple[str, ...] = setting(
        (), "Rules RANK:ITERATION:PHASE: raise there the first time it runs only.")
    hang: tuple[str, ...] = setting(
        (), "Rules RANK:ITERATION:PHASE:SECONDS: sleep there, ignoring cancellation.")
    outputs: bool = setting(True, "Write a marker file per executed action.")
    rollout_s: float = setting(
        0.0, "A simulated train rollout on each rollout node (phase 1, or phase 10 of the "
        "iteration before in an asynchronous run).", unit="s", ge=0)
    train_s: float = setting(0.0, "A simulated training step on each training node (phase 10).",
                             unit="s", ge=0)

    def check(self) -> None:
        self.rules()  # validate early, at the CLI boundary

    def rules(self) -> tuple[list[Rule], list[Rule], list[Rule], list[Rule]]:
        return (
            [Rule.parse(t, with_seconds=True) for t in self.sleeps],
            [Rule.parse(t, with_seconds=False) for t in self.fail],
            [Rule.parse(t, with_seconds=True) for t in self.hang],
            [Rule.parse(t, with_seconds=False) for t in self.fail_once],
        )


def resolve_sections(raw: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(raw) - {"scripted"})
    if unknown:
        raise UsageError(
            f"config section [{unknown[0]}] is not used by run.actions='scripted': "
            "it knows only [scripted]"
        )
    return {"scripted": to_plain(from_mapping(ScriptedConfig, raw.get("scripted", {}), "scripted"))}


class ScriptedActions:
    def __init__(self, config: ScriptedConfig, *, rank: int, run_dir: Path,
                 placement: Placement, iterations: int) -> None:
        self.config = config
        self.rank = rank
        self.run_dir = run_dir
        self.placement = placement
        self.iterations = iterations
        self.sleeps, self.fails, self.hangs, self.fail_once = config.rules()

    def _rolled_out(self, iteration: int) -> Path:
        return self._output(iteration, 0, self.rank).with_name("rollout.json")

    def simulated_work(self, phase: Phase, iteration: int) -> tuple[float, list[int]]:
        """This rank's simulated RL work in this phase (rollout_s, train_s): its
        seconds, and the iterations whose rollout it completes (marked once done)."""
        p, rank, c = self.placement, self.rank, self.config
        seconds, rolled = 0.0, []
        if phase is Phase.ROLLOUT and p.rolls_out(rank) and c.rollout_s \
                and not self._rolled_out(iteration).exists():
            seconds, rolled = seconds + c.rollout_s, [iteration]
        training = c.train_s if phase is Phase.TRAIN and p.trains(rank) else 0.0
        ahead = 0.0
        if phase is Phase.TRAIN and c.rollout_s and rule_of(p).rolls_out_next(
                rolls_out=p.rolls_out(rank), iteration=iteration, iterations=self.iterations):
            ahead, rolled = c.rollout_s, [iteration + 1]
        # A split node trains and rolls out at once, on GPUs of their own.
        return seconds + max(training, ahead), rolled

    def _output(self, iteration: int, phase: int, rank: int) -> Path:
        return (self.run_dir / layout.iteration_dir(iteration) / "scripted"
                / f"rank-{rank}" / f"phase-{phase:02d}.json")

    def run(self, phase: Phase, ctx: StepContext) -> Mapping[str, Any]:
        it = ctx.iteration
        simulated, rolled = self.simulated_work(phase, it)
        seconds = self.config.sleep_s + simulated + sum(
            r.seconds for r in self.sleeps if r.matches(self.rank, it, phase))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ctx.check_cancel()
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        for done in rolled:
            fsio.publish_bytes(self._rolled_out(done), b"{}")
        for rule in self.hangs:
            if rule.matches(self.rank, it, phase):
                time.sleep(rule.seconds)  # deliberately deaf to cancellation
        if any(r.matches(self.rank, it, phase) for r in self.fails):
            raise ActionError(f"injected failure (scripted rule) at rank {self.rank}")
        if any(r.matches(self.rank, it, phase) for r in self.fail_once):
            marker = self._output(it, phase, self.rank).with_suffix(".failed-once")
            if not marker.exists():  # this rank's own file: no other writer
                fsio.publish_bytes(marker, b"1")
                raise ActionError(f"injected one-time failure (scripted rule) at rank "
                                  f"{self.rank}")
        if self.config.outputs:
            self._record(it, phase)
        return {"rank": self.rank}

    def _record(self, iteration: int, phase: int) -> None:
        out = self._output(iteration, phase, self.rank)
        runs = 0
        # The first run of this action has no marker yet (or a foreign one).
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
            runs = int(json.loads(fsio.read_bytes(out))["runs"])
        body = {"iteration": iteration, "phase": phase, "rank": self.rank, "runs": runs + 1}
        fsio.publish_bytes(out, json.dumps(body).encode())
        log_file = self.run_dir / layout.rank_dir(self.rank) / "scripted-log.json"
        try:
            entries = json.loads(fsio.read_bytes(log_file))
        except (FileNotFoundError, ValueError):
            entries = []
        entries.append([iteration, phase])
        fsio.publish_bytes(log_file, json.dumps(entries).encode())

    def decide(
        self, phase: Phase, ctx: StepContext, arrivals: Mapping[int, Arrival]
    ) -> Mapping[str, Any]:
        return {"arrived": sorted(arrivals)}

    def partial_outputs(self, iteration: int, phase: Phase, rank: int) -> list[Path]:
        return [self._output(iteration, phase, rank)]

    def close(self) -> None:
        return None


def build(config: RunConfig, *, rank: int, num_nodes: int, run_dir: Path) -> ScriptedActions:
    scripted = from_mapping(ScriptedConfig, config.sections.get("scripted", {}), "scripted")
    return ScriptedActions(scripted, rank=rank, run_dir=run_dir,
                           placement=placement_of(config, num_nodes),
                           iterations=config.run.iterations)


def check_run(config: RunConfig, num_nodes: int, weights: Weights) -> None:
    placement.check_run(config, num_nodes, weights)


KIND = ActionKind(name="scripted", build=build, resolve_sections=resolve_sections,
                  runs_on_buckets=True, run_section=RlRunSection, check_run=check_run)
