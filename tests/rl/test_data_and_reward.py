"""verl's data and reward settings: data.train_files / data.val_files beside data.path,
reward.path / reward.function beside data.reward; one way each, refused otherwise;
a run without eval data goes on without eval; every node checks its reward file at
phase 0 and the master refuses ranks that would score differently."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.errors import UsageError
from coordinator.records.records import Arrival, ArrivalStatus
from rl.layout import Split
from rollout.reward_file import close_workers

REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
          "    return float(solution_str == str(ground_truth))\n")


@pytest.fixture(autouse=True)
def no_worker_left() -> Iterator[None]:
    yield
    close_workers()


def resolve(sections: dict[str, Any]) -> Any:
    from coordinator.machine.actions import resolve_config

    return resolve_config(sections)


def loop_of(tmp_path: Path, sections: dict[str, Any], rank: int = 0) -> Any:
    """A rank's Loop of a run with `sections` (nothing is started by building it)."""
    from rl.loop import Loop

    return Loop(resolve(sections), rank=rank, num_nodes=2, run_dir=tmp_path / "run")


def row(index: int, truth: Any = "4") -> str:
    return json.dumps({"data_source": "openai/gsm8k", "prompt": [{"role": "user",
                       "content": f"q{index}"}], "reward_model": {"ground_truth": truth},
                       "extra_info": {"index": index}}) + "\n"


def tasks_file(path: Path, n: int = 3, truth: Any = "4") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(row(i, truth) for i in range(n)))
    return str(path)


@pytest.mark.parametrize(("sections", "message"), [
    ({"data": {"path": "/d", "train_files": ["/t.parquet"]}},
     "data.path='/d' and data.train_files=['/t.parquet'] both name the tasks: give one"),
    ({"data": {"val_files": "/v.parquet"}},
     "data.val_files=['/v.parquet'] without data.train_files: give the train files too"),
    ({"data": {"train_files": ["/t.parquet", ""]}}, "holds an empty path"),
    ({"data": {"reward": "math"}, "reward": {"path": "/r.py"}},
     "data.reward='math' and reward.path='/r.py' both choose the reward: give one"),
    ({"rollout": {"agent": "m:A"}, "reward": {"path": "/r.py"}},
     "an agent scores its own episodes, so the file would never be called"),
    ({"reward": {"function": "score"}},
     "reward.function='score' names a function of reward.path, which is not set"),
    ({"reward": {"path": "/r.py", "function": "not a name"}}, "is not a Python name"),
    ({"reward": {"path": "/r.py", "timeout_s": 0}}, "reward.timeout_s=0.0 is not positive"),
    ({"custom_reward_function": {"path": "/r.py"}},
     "custom_reward_function.path: no such setting; did you mean reward.path?"),
    # Settings that could only end in failed samples, or do nothing, refused at start.
    ({"checkpoint": {"keep_best": "eval/accuracy"}, "schedule": {"eval_interval": 0}},
     "checkpoint.keep_best='eval/accuracy', but the run never evaluates"),
    ({"checkpoint": {"keep_best": "accuracy"}, "schedule": {"rollout_split": "train-only"}},
     "but the run never evaluates (schedule.rollout_split=train-only"),
    ({"model": {"path": "/m"}, "engine": {"kind": "vllm"}, "rollout": {"eval_group_size": 4}},
     "rollout.eval_group_size=4 with rollout.eval_temperature=0 on engine.kind=vllm: greedy"),
])
def test_two_ways_of_naming_the_data_or_the_reward_at_once_are_refused_naming_both(
        sections: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        resolve(sections)


def test_verl_names_point_to_ours() -> None:
    from rl.config import suggest

    assert suggest("custom_reward_function.path") == "reward.path"
    assert suggest("custom_reward_function.name") == "reward.function"


def test_a_single_path_is_a_list_of_one_and_the_reward_file_stays_off_run_json() -> None:
    config = resolve({"data": {"train_files": "/t.parquet", "val_files": ["/v.jsonl"]},
                      "reward": {"path": "/r.py", "function": "score", "timeout_s": 4}})
    assert config.sections["data"]["train_files"] == ["/t.parquet"]
    assert config.sections["reward"] == {"path": "/r.py", "function": "score", "timeout_s": 4.0}
    # Node-local: each node names the code it runs; run.json only the timeout.
    assert config.experiment()["reward"] == {"timeout_s": 4.0}


@pytest.mark.parametrize(("data", "evaluates"), [
    ("train_files only", False), ("a single file", False), ("a directory without test", False),
    ("train_files and val_files", True), ("a directory with test", True),
    ("builtin:reverse", True),
])
def test_a_run_without_eval_data_goes_on_without_eval_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, data: str, evaluates: bool) -> None:
    train = tasks_file(tmp_path / "d" / "train.jsonl")
    if data == "a directory with test":
        tasks_file(tmp_path / "d" / "test.jsonl")
    given = {"train_files only": {"train_files": train},
             "a single file": {"path": train},
             "a directory without test": {"path": str(tmp_path / "d")},
             "a directory with test": {"path": str(tmp_path / "d")},
             "train_files and val_files": {"train_files": train, "val_files": train},
             "builtin:reverse": {}}[data]
    with caplog.at_level(logging.WARNING, logger="rl.data_source"):
        schedule = resolve({"data": given}).sections["schedule"]
    assert (schedule["eval_interval"] != 0) == evaluates
    assert schedule["eval_before_train"] == evaluates
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warned) != evaluates
    if warned:
        assert "the run does not evaluate" in warned[0] and "give data.val_files" in warned[0]


def test_a_run_that_asks_for_eval_without_eval_data_is_refused_at_phase_0(
        tmp_path: Path, tiny_model: Path) -> None:
    from rl import preflight

    train = tasks_file(tmp_path / "train.jsonl")
    loop = loop_of(tmp_path, {"model": {"path": str(tiny_model)}, "data": {
        "train_files": [train]}, "schedule": {"eval_interval": 3}})
    assert loop.s.schedule.eval_interval == 3  # asked for: kept
    preflight.check_inputs(loop)
    assert len(loop.tasks(Split.TRAIN)) == 3 and loop.tasks(Split.EVAL) == {}
    with pytest.raises(UsageError, match=r"has no eval split: give data.val_files"):
        preflight.check_loop(loop)


def test_train_files_load_through_the_loop_and_a_missing_one_is_named(tmp_path: Path) -> None:
    from rl import preflight

    train, val = tasks_file(tmp_path / "t.jsonl", 4), tasks_file(tmp_path / "v.jsonl", 2)
    loop = loop_of(tmp_path, {"data": {"train_files": [train], "val_files": val}})
    preflight.check_inputs(loop)
    assert len(loop.tasks(Split.TRAIN)) == 4 and len(loop.tasks(Split.EVAL)) == 2
    loop = loop_of(tmp_path, {"data": {"train_files": [str(tmp_path / "absent.jsonl")]}})
    with pytest.raises(UsageError, match=r"data.train_files names '.*absent.jsonl', which is "
                                         r"not a file"):
        preflight.check_inputs(loop)


def arrival(rank: int, payload: dict[str, Any]) -> Arrival:
    return Arrival(run_id="r", generation=0, session="s", rank=rank, token="t", iteration=0,
                   phase=0, status=ArrivalStatus.OK, error=None, done=(), payload=payload)


def test_every_node_checks_its_own_reward_file_and_the_master_refuses_a_difference(
        tmp_path: Path) -> None:
    from rl.reward_check import check_reward_here, same_reward

    (tmp_path / "r.py").write_text(REWARD)
    master = loop_of(tmp_path, {"reward": {"path": str(tmp_path / "r.py")}})
    with_file = check_reward_here(master, master=True)
    assert with_file["reward"].startswith("reward.path's compute_score in a file of SHA-256 ")
    # A worker started without the file (reward.path is node-local) would score with
    # the data sources' defaults: refused, naming the ranks.
    bare = check_reward_here(loop_of(tmp_path, {}, rank=1), master=False)
    assert bare == {"agent": "builtin", "reward": "each data source's default"}
    with pytest.raises(UsageError, match=r"ranks 0: reward.path's compute_score .*; ranks 1: "
                                         r"each data source's default\): reward.path and "
                                         r"reward.function are node-local"):
        same_reward({0: arrival(0, with_file), 1: arrival(1, bare)})
    same_reward({0: arrival(0, with_file), 1: arrival(1, with_file), 2: arrival(2, {})})
    # A node started without the agent is named as such at phase 0, before the
    # reward it would score with (which follows from the agent).
    agent = check_reward_here(loop_of(tmp_path, {"rollout": {"agent": "m:A"}}), master=True)
    with pytest.raises(UsageError, match=r"different agents \(ranks 0: m:A; ranks 1: builtin\): "
                                         r"rollout.agent is node-local"):
        same_reward({0: arrival(0, agent), 1: arrival(1, bare)})


def test_a_workers_broken_reward_file_stops_every_node_naming_the_rank(tmp_path: Path) -> None:
    from rl.reward_check import check_reward_here, same_reward

    (tmp_path / "r.py").write_text("def other(): pass\n")
    sections = {"reward": {"path": str(tmp_path / "r.py")}}
    worker = check_reward_here(loop_of(tmp_path, sections, rank=1), master=False)
    assert "reward_problem" in worker  # reported, not raised: the master stops everyone
    with pytest.raises(UsageError, match=r"the reward cannot be used on every node: rank 1: "
                                         r"reward.path '.*r.py': it defines no 'compute_score'"):
        same_reward({0: arrival(0, {"reward": "x"}), 1: arrival(1, worker)})
    with pytest.raises(UsageError, match=r"rank 0: reward.path .* defines no 'compute_score'"):
        check_reward_here(loop_of(tmp_path, sections), master=True)


def test_a_structured_ground_truth_needs_a_reward_file(tmp_path: Path) -> None:
    from rl.reward_check import check_truths

    path = tasks_file(tmp_path / "t.jsonl", truth={"answer": 4})
    loop = loop_of(tmp_path, {"data": {"path": path}})
    with pytest.raises(UsageError, match=r"task openai/gsm8k/train/0 of data.path=.* has a dict "
                                         r"as its ground truth, but the default reward of its "
                                         r"data source compares text: give reward.path"):
        check_truths(loop.s, loop.tasks(Split.TRAIN).values())
    (tmp_path / "r.py").write_text(REWARD)
    loop = loop_of(tmp_path, {"data": {"path": path}, "reward": {"path": str(tmp_path / "r.py")}})
    check_truths(loop.s, loop.tasks(Split.TRAIN).values())


def test_greedy_eval_of_several_samples_is_refused_only_where_the_engine_refuses_it() -> None:
    """The hf engine samples n greedy answers (the same one n times); vLLM refuses."""
    resolved = resolve({"model": {"path": "/m"}, "rollout": {"eval_group_size": 2}})
    assert resolved.sections["rollout"]["eval_group_size"] == 2
