"""Phase 13's report: TensorBoard event files (read back with tensorboard's own
reader) and Weights & Biases (through a stand-in for the wandb module with its
init / log / finish interface: the real one needs an account and a network)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

from coordinator.machine.actions import StepContext, resolve_config
from coordinator.machine.runtime import Runtime
from coordinator.records.phases import Phase
from rl import layout
from rl.actions import RlActions
from rl.reporting import end_iteration

TIMINGS = {str(p): {"action_s": 0.5 + p, "wait_s": 0.25} for p in range(13)}


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(layout.tensorboard_dir(run_dir)))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def write_metrics(run_dir: Path, iteration: int) -> None:
    for name, body in (
        ("rollout", {"reward_mean": 0.1 * (iteration + 1), "accuracy": 0.2, "num_failed": 0,
                     "response_length_mean": 7.5, "samples_per_second": {"0": 3.0, "1": 1.0}}),
        ("train", {"loss": 1.0 / (iteration + 1), "kl": 0.01, "tokens": 400, "seconds": 2.0,
                   "world_size": 3}),
    ):
        path = layout.metrics(run_dir, iteration, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(body))


def context(config: Any, run_dir: Path, iteration: int) -> StepContext:
    return StepContext(rank=0, num_nodes=3, iteration=iteration, phase=Phase.FINAL_SYNC,
                       run_dir=run_dir, run_id="run1", config=config, weights=(1.0, 1.0, 1.0),
                       host="h", address="127.0.0.1", runtime=Runtime(), timings=TIMINGS)


def test_each_iteration_reports_its_scalars_to_tensorboard_once(tmp_path: Path) -> None:
    config = resolve_config({"run": {"actions": "rl"}})
    actions = RlActions(config, rank=0, num_nodes=3, run_dir=tmp_path)
    try:
        for it in (0, 1, 1):  # iteration 1's phase 13 rerun after a failure: one point
            write_metrics(tmp_path, it)
            end_iteration(actions.loop, context(config, tmp_path, it))
    finally:
        actions.close()
    found = scalars(tmp_path)
    assert found["rollout/reward_mean"] == [(0, 0.10000000149011612), (1, 0.20000000298023224)]
    assert [v for _, v in found["train/loss"]] == [1.0, 0.5]
    assert [v for _, v in found["train/tokens_per_second"]] == [200.0, 200.0]
    assert [v for _, v in found["rollout/samples_per_second"]] == [4.0, 4.0]
    assert [v for _, v in found["phase_s/10_train"]] == [10.75, 10.75]
    assert {t for t in found if t.startswith("phase_s/")} == {
        f"phase_s/{p:02d}_{Phase(p).name.lower()}" for p in range(13)}
    assert not any(t.startswith("eval/") for t in found)  # no eval ran


def test_wandb_gets_the_same_scalars_when_a_project_is_set(tmp_path: Path,
                                                            monkeypatch: Any) -> None:
    calls: list[tuple[str, Any]] = []

    class Run:
        def log(self, data: dict, step: int) -> None:
            calls.append(("log", (step, data)))

        def finish(self) -> None:
            calls.append(("finish", None))

    def init(**kwargs: Any) -> Run:
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    config = resolve_config({"run": {"actions": "rl"},
                             "metrics": {"wandb_project": "rl-exp", "tensorboard": False}})
    actions = RlActions(config, rank=0, num_nodes=3, run_dir=tmp_path)
    try:
        for it in (0, 1):
            write_metrics(tmp_path, it)
            end_iteration(actions.loop, context(config, tmp_path, it))
    finally:
        actions.close()
    assert [c[0] for c in calls] == ["init", "log", "log", "finish"]
    init_args = calls[0][1]
    assert init_args["project"] == "rl-exp" and init_args["id"] == "run1"
    assert init_args["resume"] == "allow"
    assert calls[2][1][0] == 1 and calls[2][1][1]["train/loss"] == 0.5
    assert not layout.tensorboard_dir(tmp_path).exists()
