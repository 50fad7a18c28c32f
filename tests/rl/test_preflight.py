"""The settings the model and the tasks bound: one case per rule (rl/preflight.py),
the tiny model's own defaults, and the facts read from a real model directory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from coordinator.config.run_config import RunSection, deep_merge
from coordinator.errors import UsageError
from rl import preflight, setting_rules
from rl.config import TINY_MODEL_DEFAULTS, parse_sections, resolve_sections, with_model_defaults
from rl.layout import Split
from rl.setting_rules import Facts, ModelFacts, TaskFacts


def facts(sections: dict[str, Any] | None = None, *, context: int | None = 128,
          train: int = 256, eval_: int = 64, prompt: int | None = 6,
          run: RunSection | None = None, heads: int | None = 4, chat: bool = False) -> Facts:
    """The tiny model's run on the built-in task, with `sections` changed."""
    raw = with_model_defaults(deep_merge({}, sections or {}))
    return Facts(s=parse_sections(raw), run=run or RunSection(),
                 model=ModelFacts(path=Path("/m"), context=context, attention_heads=heads),
                 tasks=TaskFacts(source="builtin:reverse", train=train, eval=eval_,
                                 longest_prompt=prompt, longest_task="reverse/train/000243",
                                 eval_as_chat=chat))


def test_the_tiny_models_defaults_pass_every_rule() -> None:
    assert setting_rules.problems(facts()) == []


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
    ("vLLM's tensor parallelism not dividing the heads",
     {"engine": {"kind": "vllm", "tensor_parallel_size": 3}}, {"heads": 28},
     ("engine.tensor_parallel_size=3", "28 attention heads", "one of 1, 2, 4, 7, 14, 28")),
    ("greedy eval of several samples of a chat prompt on the hf engine",
     {"rollout": {"eval_group_size": 2, "eval_temperature": 0.0}}, {"chat": True},
     ("rollout.eval_group_size=2", "as chat messages", "every eval sample would fail",
      "rollout.eval_group_size=1")),
]


def test_greedy_eval_of_several_samples_is_refused_only_for_chat_prompts_or_no_sampling() -> None:
    """The hf engine's completions endpoint samples n greedy answers (the same one n
    times); its chat endpoint, like vLLM's, refuses."""
    several = {"rollout": {"eval_group_size": 2, "eval_temperature": 0.0}}
    assert setting_rules.problems(facts(several, chat=False)) == []
    assert setting_rules.problems(facts({"rollout": {"eval_group_size": 2,
                                                     "eval_temperature": 1.0}}, chat=True)) == []
    never = {"eval_interval": 0, "eval_before_train": False}
    assert setting_rules.problems(facts({**several, "schedule": never}, chat=True)) == []


@pytest.mark.parametrize(("changed", "overrides", "words"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_rule_names_the_setting_its_limit_and_the_fix(
        changed: dict[str, Any], overrides: dict[str, Any], words: tuple[str, ...]) -> None:
    found = setting_rules.problems(facts(changed, **overrides))
    assert len(found) == 1, found
    for word in words:
        assert word in found[0], (word, found[0])
    with pytest.raises(UsageError, match="cannot work with this model"):
        setting_rules.check(facts(changed, **overrides))


def test_every_rule_has_a_case() -> None:
    caught = set()
    for _, changed, overrides, _words in CASES:
        f = facts(changed, **overrides)
        caught |= {rule for rule in setting_rules.RULES if rule(f) is not None}
    assert caught == set(setting_rules.RULES)


def test_several_problems_are_listed_together() -> None:
    with pytest.raises(UsageError, match=r"\(2 problems\)") as info:
        setting_rules.check(facts({"rollout": {"max_tokens": 500, "eval_tasks": 99}}))
    assert "rollout.max_tokens=500" in str(info.value) and "rollout.eval_tasks=99" in str(info.value)


def test_max_tokens_does_not_bound_an_agent_which_asks_for_its_own_lengths() -> None:
    agent = {"rollout": {"agent": "pkg.mod:Agent", "max_tokens": 1024}}
    assert setting_rules.problems(facts(agent, prompt=None)) == []


def test_eval_limits_do_not_apply_to_a_run_that_never_evaluates() -> None:
    never = {"eval_interval": 0, "eval_before_train": False}
    assert setting_rules.problems(facts({"rollout": {"eval_tasks": 99}, "schedule": never},
                                    eval_=0)) == []
    train_only = {"rollout_split": "train-only"}
    assert setting_rules.problems(facts({"schedule": train_only}, eval_=0)) == []
    rollout_only = {"rl_phase": "rollout"}
    assert setting_rules.problems(facts({"train": {"mini_batch_size": 4096},
                                     "schedule": rollout_only})) == []
    eval_only = {"rollout_split": "eval-only"}
    assert setting_rules.problems(facts({"rollout": {"tasks_per_iteration": 999},
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
    from coordinator.machine.actions import resolve_config
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


def test_tensor_parallel_size_binds_only_vllm_and_only_when_the_heads_are_known() -> None:
    assert setting_rules.problems(facts({"engine": {"tensor_parallel_size": 3}}, heads=28)) == []
    vllm = {"engine": {"kind": "vllm", "tensor_parallel_size": 4}}
    assert setting_rules.problems(facts(vllm, heads=28)) == []
    assert setting_rules.problems(facts(vllm, heads=None)) == []


# --- a 7 B recipe checked on its model's config.json and tokenizer, no weights --------

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "configs" / "qwen2.5-7b-gsm8k.toml"
# Qwen2.5-7B-Instruct's config.json, its architecture numbers as published.
QWEN25_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "bfloat16",
    "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
    "max_position_embeddings": 32768, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "use_sliding_window": False,
    "bos_token_id": 151643, "eos_token_id": 151645,
}
# ChatML, as Qwen's template writes it: a default system turn, then each message
# between <|im_start|>role and <|im_end|>, then the assistant's opening.
CHATML = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content']"
    " + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# GSM8K-style word problems written for this test, with their answers.
PROBLEMS: list[tuple[str, str]] = [
    ("A baker fills 12 trays with 9 rolls each and sells all but 15 rolls. How many rolls "
     "does she sell?", "93"),
    ("Tom reads 14 pages on Monday and twice as many on Tuesday. How many pages has he read?",
     "42"),
    ("A farmer has 3 fields of 40 rows with 25 plants in each row. A storm ruins a fifth of "
     "the plants of one field. How many plants are left on the farm?", "2800"),
    ("Maria buys 4 notebooks at $3 each and a pen for $2, paying with a $20 bill. How much "
     "change does she get?", "6"),
    ("A train leaves at 9:40 and the trip takes 2 hours 35 minutes. At how many minutes past "
     "noon does it arrive?", "15"),
]


def qwen_shaped_model(path: Path) -> Path:
    """A directory with Qwen2.5-7B's config.json and a byte-level BPE tokenizer trained
    here on the problems' words (ChatML's special tokens, the chat template), and no
    weights: what a user has before downloading them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [text for text, _ in PROBLEMS] + [INSTRUCTION, "You are a helpful assistant."]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                            pad_token="<|endoftext|>", chat_template=CHATML).save_pretrained(path)
    (path / "config.json").write_text(json.dumps(QWEN25_7B))
    return path


def gsm8k_style_data(path: Path) -> Path:
    """train.parquet and test.parquet in verl's GSM8K layout (examples/data_preprocess/
    gsm8k.py's columns): the problems above, repeated to a few hundred rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.mkdir(parents=True)
    for split, rows in (("train", 600), ("test", 40)):
        pq.write_table(pa.Table.from_pylist([{
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{PROBLEMS[i % 5][0]} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": PROBLEMS[i % 5][1]},
            "extra_info": {"split": split, "index": i},
        } for i in range(rows)]), path / f"{split}.parquet")
    return path


def recipe_nodes() -> tuple[int, str]:
    """--num-nodes and --rank-weights of the master's command in the recipe's header."""
    import re

    found = re.search(r"coordinator run --master --num-nodes (\d+) --rank-weights ([\d,]+) "
                      r"--config (\S+)", RECIPE.read_text())
    assert found is not None, "the recipe's header gives no master command line"
    assert ROOT / found.group(3) == RECIPE
    return int(found.group(1)), found.group(2)


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    where = tmp_path_factory.mktemp("qwen7b")
    return qwen_shaped_model(where / "model"), gsm8k_style_data(where / "gsm8k")


def recipe_on(model: Path, data: Path, changed: dict[str, Any] | None = None) -> Any:
    """The 7 B recipe with model.path and data.path pointing here, `changed` over it."""
    from coordinator.config.run_config import load_file
    from coordinator.machine.actions import resolve_config

    raw = deep_merge(load_file(RECIPE), {"model": {"path": str(model)},
                                         "data": {"path": str(data)}})
    return resolve_config(deep_merge(raw, changed or {}))


def test_the_7b_recipe_passes_every_check_on_its_models_config_and_tokenizer_but_weights(
        qwen7b: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    from coordinator_cli.args import parse_weights

    model, data = qwen7b
    nodes, weights = recipe_nodes()
    assert len(parse_weights(weights, num_nodes=nodes) or ()) == nodes == 4
    found = preflight.check_setup(recipe_on(model, data), num_nodes=nodes)
    # The one problem: the weights, named with what to do.
    assert len(found.problems) == 1, found.problems
    assert f"model.path {model} holds no weights (*.safetensors" in found.problems[0]
    f = found.facts
    assert f is not None
    assert (f.model.context, f.model.attention_heads, f.context) == (32768, 28, 2048)
    assert (f.tasks.train, f.tasks.eval) == (600, 40)
    # The prompts were measured through the chat template, as the engine will count them.
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    longest = max(PROBLEMS, key=lambda p: len(tokenizer(f"{p[0]} {INSTRUCTION}")["input_ids"]))
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{longest[0]} {INSTRUCTION}"}],
        add_generation_prompt=True, tokenize=True)
    rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    assert f.tasks.longest_prompt == len(rendered)
    assert f.tasks.longest_prompt > len(tokenizer(f"{longest[0]} {INSTRUCTION}")["input_ids"]) + 10
    # Weights in place, nothing is left to refuse.
    with_weights = model.parent / "with-weights"
    with_weights.mkdir()
    for file in model.iterdir():
        (with_weights / file.name).write_bytes(file.read_bytes())
    (with_weights / "model.safetensors").write_bytes(b"")
    assert preflight.check_setup(recipe_on(with_weights, data), num_nodes=nodes).problems == ()


def besides_weights(found: preflight.SetupCheck) -> list[str]:
    """The problems found other than the missing weights (which must be one of them),
    each cut to the words the cases below expect of it."""
    weights = [p for p in found.problems if "holds no weights" in p]
    assert len(weights) == 1, found.problems
    return [next((w for w in EXPECTED if w in p), p) for p in found.problems if p not in weights]


PROBLEM_CASES: list[tuple[dict[str, Any], str]] = [
    ({"engine": {"tensor_parallel_size": 8, "data_parallel_size": 1}},
     "engine.tensor_parallel_size=8 does not divide the 28 attention heads"),
    ({"rollout": {"max_tokens": 2000}}, "rollout.max_tokens=2000 plus the longest prompt"),
    ({"run": {"train_nodes": "0:0-3", "rollout_nodes": "0:4-7,1-3"}},
     "needs 8 GPUs but cuda_visible_devices='4,5,6,7' shows 4"),
    ({"run": {"train_nodes": "0:0-3", "rollout_nodes": "1-3"}},
     "node 0 4 GPU(s) to train on, but torchrun.nproc_per_node=8"),
    ({"rollout": {"tasks_per_iteration": 601}}, "rollout.tasks_per_iteration=601 exceeds the 600"),
    ({"data": {"reward": "no-such-reward"}}, "data.reward='no-such-reward'"),
]


@pytest.mark.parametrize(("changed", "words"), PROBLEM_CASES,
                         ids=["tp-vs-heads", "context", "rollout-gpus", "train-gpus",
                              "train-split", "reward"])
def test_each_check_catches_its_problem_in_the_7b_recipe_on_that_shape(
        qwen7b: tuple[Path, Path], changed: dict[str, Any], words: str) -> None:
    model, data = qwen7b
    assert besides_weights(preflight.check_setup(recipe_on(model, data, changed), num_nodes=4))\
        == [words]


def test_a_model_directory_whose_template_or_config_cannot_be_used_is_named(
        qwen7b: tuple[Path, Path], tmp_path: Path) -> None:
    model, data = qwen7b
    no_template, unknown = tmp_path / "no-template", tmp_path / "unknown"
    for copy in (no_template, unknown):
        copy.mkdir()
        for file in model.iterdir():
            if not (copy is no_template and file.name == "chat_template.jinja"):
                (copy / file.name).write_bytes(file.read_bytes())
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no-such-arch"}))
    assert besides_weights(preflight.check_setup(recipe_on(no_template, data), num_nodes=4),
                           ) == ["its chat template cannot render the prompt of task"]
    assert besides_weights(preflight.check_setup(recipe_on(unknown, data), num_nodes=4)) \
        == ["transformers cannot parse its config.json"]


EXPECTED: tuple[str, ...] = (
    *(c[1] for c in PROBLEM_CASES), "its chat template cannot render the prompt of task",
    "transformers cannot parse its config.json")
