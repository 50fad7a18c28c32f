"""The settings the model and the tasks bound: one case per rule (rl/preflight.py),
the tiny model's own defaults, and the facts read from a real model directory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import RunSection, deep_merge
from coordinator.errors import UsageError
from rl import preflight
from rl.config import TINY_MODEL_DEFAULTS, parse_sections, resolve_sections, with_model_defaults
from rl.layout import Split
from rl.preflight import Facts, ModelFacts, TaskFacts


def facts(sections: dict[str, Any] | None = None, *, context: int | None = 128,
          train: int = 256, eval_: int = 64, prompt: int | None = 6,
          run: RunSection | None = None) -> Facts:
    """The tiny model's run on the built-in task, with `sections` changed."""
    raw = with_model_defaults(deep_merge({}, sections or {}))
    return Facts(s=parse_sections(raw), run=run or RunSection(),
                 model=ModelFacts(path=Path("/m"), context=context),
                 tasks=TaskFacts(source="builtin:reverse", train=train, eval=eval_,
                                 longest_prompt=prompt, longest_task="reverse/train/000243"))


def test_the_tiny_models_defaults_pass_every_rule() -> None:
    assert preflight.problems(facts()) == []


def test_the_tiny_models_defaults_give_way_to_any_value_a_config_sets() -> None:
    resolved = resolve_sections({"rollout": {"max_tokens": 9}, "train": {"epochs": 1}})
    assert resolved["rollout"]["max_tokens"] == 9 and resolved["train"]["epochs"] == 1
    assert resolved["rollout"]["eval_tasks"] == TINY_MODEL_DEFAULTS["rollout"]["eval_tasks"]
    # A model of one's own keeps the defaults for a real model.
    real = resolve_sections({"model": {"path": "/models/qwen"}})
    assert real["rollout"]["max_tokens"] == 1024 and real["train"]["lr"] == 1e-6


# (changed settings, fact overrides, words the one message must hold)
CASES: list[tuple[str, dict[str, Any], dict[str, Any], tuple[str, ...]]] = [
    ("max_tokens past the context", {"rollout": {"max_tokens": 1024}}, {},
     ("rollout.max_tokens=1024", "6 tokens, task reverse/train/000243", "1030 positions",
      "accepts 128", "at most 122")),
    ("max_tokens past engine.max_model_len", {"rollout": {"max_tokens": 60},
                                              "engine": {"max_model_len": 64}}, {},
     ("rollout.max_tokens=60", "accepts 64", "engine.max_model_len=64", "at most 58")),
    ("a prompt longer than the context", {}, {"prompt": 130},
     ("130 tokens", "shorten the prompts")),
    ("max_tokens filling the context, prompts unknown", {"rollout": {"max_tokens": 128}},
     {"prompt": None}, ("rollout.max_tokens=128", "no room for a prompt", "at most 127")),
    ("max_model_len past the model", {"engine": {"max_model_len": 512}}, {},
     ("engine.max_model_len=512", "128 positions", "at most 128")),
    ("more train tasks than the split", {"rollout": {"tasks_per_iteration": 300}}, {},
     ("rollout.tasks_per_iteration=300", "256 tasks of the train split", "at most 256",
      "0 for the whole split")),
    ("an empty train split", {}, {"train": 0}, ("has no tasks",)),
    ("more eval tasks than the split", {"rollout": {"eval_tasks": 65}}, {},
     ("rollout.eval_tasks=65", "64 tasks of the eval split", "at most 64")),
    ("no eval split in a run that evaluates", {}, {"eval_": 0},
     ("no eval split", "schedule.eval_interval=0")),
    ("a mini-batch larger than an iteration", {"rollout": {"tasks_per_iteration": 8},
                                               "train": {"mini_batch_size": 128}}, {},
     ("train.mini_batch_size=128", "64 samples", "8 tasks x rollout.group_size=8",
      "at most 64")),
    ("a minimum batch the failure budget cannot meet",
     {"rollout": {"min_batch_fraction": 0.95, "max_failed_fraction": 0.1}}, {},
     ("rollout.min_batch_fraction=0.95", "rollout.max_failed_fraction=0.1")),
]


@pytest.mark.parametrize(("changed", "overrides", "words"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_rule_names_the_setting_its_limit_and_the_fix(
        changed: dict[str, Any], overrides: dict[str, Any], words: tuple[str, ...]) -> None:
    found = preflight.problems(facts(changed, **overrides))
    assert len(found) == 1, found
    for word in words:
        assert word in found[0], (word, found[0])
    with pytest.raises(UsageError, match="cannot work with this model"):
        preflight.check(facts(changed, **overrides))


def test_every_rule_has_a_case() -> None:
    caught = set()
    for _, changed, overrides, _words in CASES:
        f = facts(changed, **overrides)
        caught |= {rule for rule in preflight.RULES if rule(f) is not None}
    assert caught == set(preflight.RULES)


def test_several_problems_are_listed_together() -> None:
    with pytest.raises(UsageError, match=r"\(2 problems\)") as info:
        preflight.check(facts({"rollout": {"max_tokens": 500, "eval_tasks": 99}}))
    assert "rollout.max_tokens=500" in str(info.value) and "rollout.eval_tasks=99" in str(info.value)


def test_max_tokens_does_not_bound_an_agent_which_asks_for_its_own_lengths() -> None:
    agent = {"rollout": {"agent": "pkg.mod:Agent", "max_tokens": 1024}}
    assert preflight.problems(facts(agent, prompt=None)) == []


def test_eval_limits_do_not_apply_to_a_run_that_never_evaluates() -> None:
    never = {"eval_interval": 0, "eval_before_train": False}
    assert preflight.problems(facts({"rollout": {"eval_tasks": 99}, "schedule": never},
                                    eval_=0)) == []
    train_only = {"rollout_split": "train-only"}
    assert preflight.problems(facts({"schedule": train_only}, eval_=0)) == []
    rollout_only = {"rl_phase": "rollout"}
    assert preflight.problems(facts({"train": {"mini_batch_size": 4096},
                                     "schedule": rollout_only})) == []
    eval_only = {"rollout_split": "eval-only"}
    assert preflight.problems(facts({"rollout": {"tasks_per_iteration": 999},
                                     "schedule": eval_only})) == []


def test_facts_come_from_the_models_config_and_its_tokenizer(tiny_model: Path) -> None:
    from rollout.tasks import BuiltinReverseTasks

    model = preflight.model_facts(tiny_model)
    assert model.context == 128
    tasks = BuiltinReverseTasks(seed=0).tasks("train")
    length, task = preflight.longest_prompt(tiny_model, tasks) or (0, "")
    longest = max(tasks, key=lambda t: len(str(t.prompt)))
    # A character tokenizer: one token per character plus the start token.
    assert length == len(str(longest.prompt)) + 1 and task.startswith("reverse/train/")


def test_a_model_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"has no readable config\.json"):
        preflight.model_facts(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert preflight.model_facts(tmp_path).context is None


def test_facts_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts().model.context = 1  # type: ignore[misc]


# --- the user's model and data, checked before anything is built ---------------------


def loop_of(tmp_path: Path, sections: dict[str, Any]) -> Any:
    """The master's Loop of a run with `sections` (nothing is started by building it)."""
    from coordinator.actions import resolve_config
    from rl.loop import Loop

    return Loop(resolve_config(sections), rank=0, num_nodes=1, run_dir=tmp_path / "run")


def chat_task(index: int, content: str) -> str:
    return json.dumps({"prompt": [{"role": "user", "content": content}], "data_source": "mine",
                       "reward_model": {"ground_truth": "1"}, "extra_info": {"index": index}})


NEVER_EVAL = {"eval_interval": 0, "eval_before_train": False}


@pytest.mark.parametrize(("files", "words"), [
    (None, "does not exist, is not a directory"),
    ((), "has no config.json"),
    (("config.json", "tokenizer.json"), "holds no weights"),
    (("config.json", "model.safetensors"), "holds no tokenizer"),
    (("config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
      "tokenizer.model"), None),
    (("config.json", "pytorch_model.bin", "vocab.json"), None),
])
def test_a_model_directory_needs_its_config_weights_and_tokenizer(
        files: tuple[str, ...] | None, words: str | None) -> None:
    found = preflight.model_dir_problem(Path("/models/m"), files)
    if words is None:
        assert found is None
    else:
        assert found is not None and words in found and "model.path /models/m" in found, found


def test_a_missing_model_or_data_path_is_refused_at_once_with_the_fix(tmp_path: Path) -> None:
    loop = loop_of(tmp_path, {"model": {"path": str(tmp_path / "nope")},
                              "data": {"path": str(tmp_path / "tasks.jsonl")}})
    with pytest.raises(UsageError, match=r"\(2 problems\)") as info:
        preflight.check_inputs(loop)
    text = str(info.value)
    assert f"model.path {tmp_path / 'nope'} does not exist" in text
    assert f"data.path '{tmp_path / 'tasks.jsonl'}' does not exist: give --data-path" in text
    # What to do next: a changed setting makes a new run; never `recover`, which cannot help.
    assert "--new-run if a setting changed" in text and "recover" not in text


def test_a_bad_row_of_the_users_data_is_a_setting_to_fix_not_a_failed_step(
        tmp_path: Path) -> None:
    (tmp_path / "tasks.jsonl").write_text(chat_task(0, "hi") + "\n{not json\n")
    loop = loop_of(tmp_path, {"data": {"path": str(tmp_path / "tasks.jsonl")}})
    with pytest.raises(UsageError, match=r"line 2: not valid JSON.*--new-run"):
        preflight.check_inputs(loop)


def test_the_users_model_and_data_may_be_symlinks(tmp_path: Path, tiny_model: Path) -> None:
    # A Hugging Face cache snapshot: every file a symlink into blobs/; the data kept
    # elsewhere, linked as the task file and as a directory's train.jsonl.
    snapshot, blobs, data = tmp_path / "snapshot", tmp_path / "blobs", tmp_path / "data"
    for d in (snapshot, blobs, data):
        d.mkdir()
    for f in tiny_model.iterdir():
        (blobs / f.name).write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(blobs / f.name)
    (data / "real.jsonl").write_text("".join(chat_task(i, "12") + "\n" for i in range(3)))
    (tmp_path / "tasks.jsonl").symlink_to(data / "real.jsonl")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "train.jsonl").symlink_to(data / "real.jsonl")
    for source in ("tasks.jsonl", "dir"):
        loop = loop_of(tmp_path, {"model": {"path": str(snapshot)},
                                  "data": {"path": str(tmp_path / source), "reward": "exact_match"},
                                  "schedule": NEVER_EVAL})
        preflight.check_inputs(loop)
        assert len(loop.tasks(Split.TRAIN)) == 3 and loop.tasks(Split.EVAL) == {}


def test_a_chat_prompt_of_the_users_data_is_measured_through_the_chat_template(
        tmp_path: Path, tiny_model: Path) -> None:
    # The tiny model's context is 128 positions; its template adds the role markers.
    (tmp_path / "tasks.jsonl").write_text(chat_task(0, "7" * 100) + "\n" + chat_task(1, "1")
                                          + "\n")
    sections = {"model": {"path": str(tiny_model)},
                "data": {"path": str(tmp_path / "tasks.jsonl"), "reward": "exact_match"},
                "rollout": {"max_tokens": 20, "tasks_per_iteration": 2, "group_size": 2},
                "train": {"mini_batch_size": 0}, "schedule": NEVER_EVAL}
    loop = loop_of(tmp_path, sections)
    preflight.check_inputs(loop)
    with pytest.raises(UsageError, match=r"rollout\.max_tokens=20 plus the longest prompt "
                                         r"\(1\d\d tokens, task mine/train/0\)") as info:
        preflight.check_loop(loop)
    assert "--new-run if a setting changed" in str(info.value)
    # The same data run without evaluating, with room for the answer: no objection.
    preflight.check_loop(loop_of(tmp_path, deep_merge(sections, {"rollout": {"max_tokens": 6}})))
