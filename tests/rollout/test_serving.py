"""The engine's verbs: each decision a table, each verb on an engine that records its calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rollout.engines.config import EngineConfig, EngineError, EngineState, WeightUpdate
from rollout.engines.serving import park, park_step, serve, serve_step
from rollout.engines.weight_updates import WEIGHT_UPDATES, Parked, Served, UpdateRule


def rule(reloads: bool) -> UpdateRule:
    return WEIGHT_UPDATES[WeightUpdate.RELOAD if reloads else WeightUpdate.RESTART]

PARK_TABLE = [
    (EngineState.READY, True, Parked.ASLEEP),
    (EngineState.READY, False, Parked.STOPPED),
    (EngineState.SLEEPING, True, Parked.IDLE),
    (EngineState.STOPPED, True, Parked.IDLE),
    (EngineState.STOPPED, False, Parked.IDLE),
    (EngineState.FAILED, True, Parked.IDLE),
    (EngineState.STARTING, True, Parked.IDLE),
    (EngineState.STOPPING, False, Parked.IDLE),
    (None, True, Parked.IDLE),
]

SERVE_TABLE = [  # state, the model served, reloads in place -> the verb
    (EngineState.READY, True, False, Served.KEPT),
    (EngineState.READY, True, True, Served.KEPT),
    (EngineState.READY, False, False, Served.RESTARTED),
    (EngineState.READY, False, True, Served.UPDATED),
    (EngineState.SLEEPING, True, True, Served.RELOADED),
    (EngineState.SLEEPING, False, True, Served.RELOADED),
    (EngineState.STOPPED, False, True, Served.STARTED),
    (EngineState.FAILED, False, True, Served.STARTED),
    (EngineState.STARTING, False, False, Served.STARTED),
    (EngineState.STOPPING, False, False, Served.STARTED),
    (None, False, True, Served.STARTED),
]


@pytest.mark.parametrize(("state", "reloads", "parked"), PARK_TABLE)
def test_park_decides_from_the_engine_state_and_the_weight_update_mode(
        state: EngineState | None, reloads: bool, parked: Parked) -> None:
    assert park_step(state, rule(reloads)) is parked


@pytest.mark.parametrize(("state", "same", "reloads", "served"), SERVE_TABLE)
def test_serve_decides_from_the_engine_state_and_the_model_served(
        state: EngineState | None, same: bool, reloads: bool, served: Served) -> None:
    assert serve_step(state, rule(reloads), same_model=same) is served


def test_the_tables_cover_every_engine_state() -> None:
    states = {*EngineState, None}
    assert {row[0] for row in PARK_TABLE} == states
    assert {row[0] for row in SERVE_TABLE} == states


@dataclass
class RecordingEngine:
    """The Engine interface's state machine, recording each call; `fail` names calls that raise."""

    config: EngineConfig
    state: EngineState = EngineState.STOPPED
    fail: set[str] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)

    def _do(self, name: str, then: EngineState) -> None:
        self.calls.append(name)
        if name in self.fail:
            self.state = EngineState.FAILED
            raise EngineError(f"{name} failed (injected)")
        self.state = then

    def start(self, model_dir: Path) -> None:
        self._do(f"start {model_dir.name}", EngineState.READY)

    def stop(self) -> None:
        self._do("stop", EngineState.STOPPED)

    def sleep(self, level: int | None = None) -> None:
        self._do("sleep", EngineState.SLEEPING)

    def load_weights(self, model_dir: Path) -> None:
        self._do(f"load {model_dir.name}", EngineState.READY)

    def update_weights(self, model_dir: Path) -> None:
        self._do(f"update {model_dir.name}", EngineState.READY)

    def check_alive(self) -> None:
        self.calls.append("check_alive")


def engine(mode: WeightUpdate, state: EngineState, fail: set[str] | None = None) -> RecordingEngine:
    return RecordingEngine(EngineConfig(weight_update=mode), state, fail or set())


def test_park_sleeps_in_reload_mode_and_stops_when_the_sleep_fails() -> None:
    e = engine(WeightUpdate.RELOAD, EngineState.READY)
    assert park(e) is Parked.ASLEEP  # type: ignore[arg-type]
    assert e.calls == ["sleep"]
    e = engine(WeightUpdate.RELOAD, EngineState.READY, {"sleep"})
    assert park(e) is Parked.STOPPED  # type: ignore[arg-type]
    assert e.calls == ["sleep", "stop"]
    e = engine(WeightUpdate.RESTART, EngineState.READY)
    assert park(e) is Parked.STOPPED  # type: ignore[arg-type]
    assert e.calls == ["stop"]
    assert park(None) is Parked.IDLE


def test_serve_reloads_a_sleeping_engine_and_restarts_when_the_reload_fails(tmp_path: Path) -> None:
    new = tmp_path / "iter_000002"
    e = engine(WeightUpdate.RELOAD, EngineState.SLEEPING)
    assert serve(e, new, serving=tmp_path / "iter_000001") is Served.RELOADED  # type: ignore[arg-type]
    assert e.calls == ["load iter_000002"]
    e = engine(WeightUpdate.RELOAD, EngineState.SLEEPING, {"load iter_000002"})
    assert serve(e, new, serving=None) is Served.RESTARTED_AFTER_FAILED_RELOAD  # type: ignore[arg-type]
    assert e.calls == ["load iter_000002", "stop", "start iter_000002"]


def test_serve_keeps_restarts_or_starts_and_a_failed_start_is_raised(tmp_path: Path) -> None:
    model = tmp_path / "iter_000001"
    e = engine(WeightUpdate.RESTART, EngineState.READY)
    assert serve(e, model, serving=model) is Served.KEPT  # type: ignore[arg-type]
    assert serve(e, tmp_path / "iter_000002", serving=model) is Served.RESTARTED  # type: ignore[arg-type]
    assert e.calls == ["check_alive", "stop", "start iter_000002"]
    e = engine(WeightUpdate.RESTART, EngineState.STOPPED, {"start iter_000001"})
    with pytest.raises(EngineError, match="start iter_000001 failed"):
        serve(e, model, serving=None)  # type: ignore[arg-type]


def test_a_serving_engine_is_updated_in_place_and_restarted_when_that_fails(
        tmp_path: Path) -> None:
    old, new = tmp_path / "iter_000001", tmp_path / "iter_000002"
    e = engine(WeightUpdate.RELOAD, EngineState.READY)
    assert serve(e, new, serving=old) is Served.UPDATED  # type: ignore[arg-type]
    assert e.calls == ["update iter_000002"] and e.state is EngineState.READY
    e = engine(WeightUpdate.RELOAD, EngineState.READY, {"update iter_000002"})
    assert serve(e, new, serving=old) is Served.RESTARTED_AFTER_FAILED_RELOAD  # type: ignore[arg-type]
    assert e.calls == ["update iter_000002", "stop", "start iter_000002"]


def test_every_weight_update_mode_has_a_rule_and_a_docs_row() -> None:
    from rollout.engines.weight_updates import markdown_table

    assert set(WEIGHT_UPDATES) == set(WeightUpdate)
    rows = markdown_table().splitlines()[2:]
    assert [row.split(" | ")[0].strip("| `") for row in rows] == [m.value for m in WeightUpdate]
    # Only the mode that keeps the process sleeps, and asks for the sleep endpoints.
    for mode, r in WEIGHT_UPDATES.items():
        assert (r.park is Parked.ASLEEP) == r.keeps_process == bool(r.sleep_mode_flags), mode
