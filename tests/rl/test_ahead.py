"""A split node's phase 10 (rl/ahead.py): training in the phase's thread, the next
iteration's rollout in its own.  The rollout here is a stand-in with the real
call's interface: it generates "groups" until done, checking for cancellation
between them, as rl/rollouts.py does."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from coordinator.config.run_config import RunConfig
from coordinator.errors import ActionError, Cancelled
from coordinator.machine.actions import StepContext
from coordinator.machine.runtime import Runtime
from coordinator.records.phases import Phase
from rl import ahead, rollouts

GROUP_S = 0.05


def context(tmp_path: Path) -> StepContext:
    return StepContext(rank=0, num_nodes=1, iteration=3, phase=Phase.TRAIN, run_dir=tmp_path,
                       run_id="0123456789ab", config=RunConfig.from_dict({}), weights=(1.0,),
                       host="node-a", address="127.0.0.1", runtime=Runtime())


class Rollout:
    """roll_out_next's stand-in: `groups` groups, or an error after `fail_after`."""

    def __init__(self, groups: int, fail_after: int | None = None) -> None:
        self.groups, self.fail_after = groups, fail_after
        self.done = 0
        self.seen_cancel: BaseException | None = None
        self.thread: threading.Thread | None = None

    def __call__(self, loop: Any, ctx: StepContext) -> dict[str, Any]:
        self.thread = threading.current_thread()
        try:
            for _ in range(self.groups):
                ctx.check_cancel()
                if self.done == self.fail_after:
                    raise ActionError("the engine answered 500")
                time.sleep(GROUP_S)
                self.done += 1
        except Cancelled as exc:
            self.seen_cancel = exc
            raise
        return {"iteration": ctx.iteration + 1, "groups": self.done}


@pytest.fixture
def rollout(monkeypatch: pytest.MonkeyPatch) -> Rollout:
    fake = Rollout(groups=10)
    monkeypatch.setattr(rollouts, "roll_out_next", fake)
    return fake


def test_both_finish_and_the_phase_reports_both(tmp_path: Path, rollout: Rollout) -> None:
    done = ahead.train_alongside(None, context(tmp_path), lambda: {"seconds": 0.1})  # type: ignore[arg-type]
    assert done == {"seconds": 0.1, "next_rollout": {"iteration": 4, "groups": 10}}
    assert rollout.thread is not threading.main_thread()


def test_training_that_fails_stops_the_rollout_before_the_phase_fails(
        tmp_path: Path, rollout: Rollout) -> None:
    def train() -> dict[str, Any]:
        time.sleep(3 * GROUP_S)
        raise ActionError("trainer rank 1 died")

    with pytest.raises(ActionError, match="trainer rank 1 died"):
        ahead.train_alongside(None, context(tmp_path), train)  # type: ignore[arg-type]
    assert rollout.thread is not None and not rollout.thread.is_alive()
    assert isinstance(rollout.seen_cancel, Cancelled) and rollout.done < rollout.groups


def test_a_failed_rollout_fails_the_phase_once_training_is_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollouts, "roll_out_next", Rollout(groups=10, fail_after=2))
    trained = []
    with pytest.raises(ActionError, match="500"):
        ahead.train_alongside(None, context(tmp_path),  # type: ignore[arg-type]
                              lambda: trained.append(1) or {})
    assert trained == [1]


def test_the_group_stopping_stops_the_rollout_too(tmp_path: Path, rollout: Rollout) -> None:
    ctx = context(tmp_path)

    def train() -> dict[str, Any]:
        ctx.runtime.cancel.set()  # what Runtime.fail does when a peer is lost
        return {}

    with pytest.raises(Cancelled):
        ahead.train_alongside(None, ctx, train)  # type: ignore[arg-type]
    assert rollout.thread is not None and not rollout.thread.is_alive()


# ------------------------------------------------- the split node's GPUs (rl/loop.py)


def test_a_split_node_gives_its_engine_and_its_trainer_their_own_gpus(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rl.config import parse_sections
    from rl.loop import placed_on_gpus
    from rl.placement import Placement
    from trainer.config import Offload

    p = Placement.of(rollout_nodes="0:4-7,1", train_nodes="0:0-3", max_off_policy_steps=1,
                     num_nodes=2)
    s = parse_sections({"torchrun": {"nproc_per_node": 4}})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    placed, trainer = placed_on_gpus(s, p, 0)
    assert (placed.engine.cuda_visible_devices, trainer) == ("4,5,6,7", "0,1,2,3")
    # Training has GPUs of its own on every node of a disaggregated run: its state
    # stays on them between jobs (train.offload "auto" -> "off").
    assert placed.train.offload is Offload.OFF
    whole, devices = placed_on_gpus(s, p, 1)  # a whole node: the daemon's own GPUs
    assert (whole.engine, devices, whole.train.offload) == (s.engine, None, Offload.OFF)
    colocated = Placement.of(rollout_nodes="", train_nodes="", max_off_policy_steps=0,
                             num_nodes=2)
    assert placed_on_gpus(s, colocated, 0) == (s, None)  # auto: offload where they share
    explicit = parse_sections({"torchrun": {"nproc_per_node": 4}, "train": {"offload": "on"}})
    assert placed_on_gpus(explicit, p, 1)[0].train.offload is Offload.ON
    # Under a scheduler's CUDA_VISIBLE_DEVICES the indices pick from what it shows.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b,GPU-c,GPU-d,GPU-e,GPU-f,GPU-g,GPU-h")
    placed, trainer = placed_on_gpus(s, p, 0)
    assert (placed.engine.cuda_visible_devices, trainer) == ("GPU-e,GPU-f,GPU-g,GPU-h",
                                                             "GPU-a,GPU-b,GPU-c,GPU-d")


@pytest.mark.parametrize(("sections", "said"), [
    ({"torchrun": {"nproc_per_node": 2}}, "gives node 0 4 GPU(s) to train on, but "
                                          "torchrun.nproc_per_node=2"),
    ({"torchrun": {"nproc_per_node": 4}, "engine": {"cuda_visible_devices": "5"}},
     "engine.cuda_visible_devices='5' and run.rollout_nodes (node 0: GPUs 4,5,6,7) both"),
    ({"torchrun": {"nproc_per_node": 4}, "engine": {"kind": "vllm", "tensor_parallel_size": 8}},
     "needs 8 GPUs but cuda_visible_devices='4,5,6,7' shows 4"),
])
def test_gpus_that_do_not_fit_the_settings_are_refused_naming_both(
        monkeypatch: pytest.MonkeyPatch, sections: dict[str, Any], said: str) -> None:
    from coordinator.errors import UsageError
    from rl.config import parse_sections
    from rl.loop import placed_on_gpus
    from rl.placement import Placement

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    p = Placement.of(rollout_nodes="0:4-7", train_nodes="0:0-3", max_off_policy_steps=1,
                     num_nodes=1)
    with pytest.raises(UsageError) as caught:
        placed_on_gpus(parse_sections(sections), p, 0)
    assert said in str(caught.value)


def test_the_master_refuses_gpu_ranges_that_do_not_fit_before_writing_run_json(
        tmp_path: Path) -> None:
    from coordinator.errors import UsageError
    from coordinator.machine.runplan import RunRequest, make_plan

    request = RunRequest(run_dir=tmp_path, rank=0, num_nodes=2, weights=None, config_file=None,
                         overrides={"run": {"actions": "rl", "train_nodes": "0:0-1",
                                            "rollout_nodes": "0:2-3,1"}})
    with pytest.raises(UsageError, match=r"gives node 0 2 GPU\(s\) to train on, but "
                                         r"torchrun.nproc_per_node=1"):
        make_plan(request)
    assert not (tmp_path / "run.json").exists()
