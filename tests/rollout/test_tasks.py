from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout.errors import TaskDataError
from rollout.task_files import JsonlTasks, ParquetTasks, load_task_files
from rollout.tasks import BuiltinReverseTasks, load_task_source


def verl_row(index: int | None, *, source: str = "openai/gsm8k", truth: Any = "42") -> dict:
    row: dict[str, Any] = {
        "data_source": source,
        "prompt": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": f"question {index}"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
    }
    if index is not None:
        row["extra_info"] = {"split": "train", "index": index}
    return row


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_builtin_source_is_the_same_for_the_same_seed_and_differs_across_seeds() -> None:
    a = load_task_source("builtin:reverse", seed=3).tasks("train")
    b = load_task_source("builtin:reverse", seed=3).tasks("train")
    c = load_task_source("builtin:reverse", seed=4).tasks("train")
    assert a == b
    assert [t.prompt for t in a] != [t.prompt for t in c]
    assert isinstance(load_task_source("builtin:reverse", seed=0), BuiltinReverseTasks)


def test_unknown_builtin_is_refused_listing_the_known_one() -> None:
    with pytest.raises(TaskDataError, match=r"builtin:nope.*known: builtin:reverse"):
        load_task_source("builtin:nope", seed=0)


def test_parquet_directory_gives_train_and_test_splits_with_ids_from_source_and_index(
    tmp_path: Path,
) -> None:
    write_parquet(tmp_path / "train.parquet", [verl_row(7), verl_row(9)])
    write_parquet(tmp_path / "test.parquet", [verl_row(7)])
    source = load_task_source(str(tmp_path), seed=0)
    assert isinstance(source, ParquetTasks)
    train = source.tasks("train")
    assert [t.task_id for t in train] == ["openai/gsm8k/train/7", "openai/gsm8k/train/9"]
    assert train[1].ground_truth == "42"
    assert train[0].messages() == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "question 7"},
    ]
    (only,) = source.tasks("eval")
    assert only.task_id == "openai/gsm8k/eval/7" and only.split == "eval"


def test_rows_without_extra_info_get_ids_from_their_row_number(tmp_path: Path) -> None:
    rows = [verl_row(None), verl_row(None)]
    source = ParquetTasks(write_parquet(tmp_path / "x.parquet", rows))
    assert [t.task_id for t in source.tasks("train")] == [
        "openai/gsm8k/train/row-0",
        "openai/gsm8k/train/row-1",
    ]


def test_jsonl_directory_reads_train_and_eval_with_the_same_fields(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", [verl_row(1), verl_row(2)])
    write_jsonl(tmp_path / "eval.jsonl", [{**verl_row(5), "prompt": "plain text prompt"}])
    source = load_task_source(str(tmp_path), seed=0)
    assert isinstance(source, JsonlTasks)
    assert len(source.tasks("train")) == 2
    (task,) = source.tasks("eval")
    assert task.prompt == "plain text prompt" and task.messages() is None


def test_numeric_ground_truths_are_written_out_as_text_and_kept_as_numbers(
        tmp_path: Path) -> None:
    source = JsonlTasks(write_jsonl(tmp_path / "a.jsonl", [
        verl_row(1, truth=3), verl_row(2, truth=0.5), verl_row(3, truth=True)]))
    # The registered rewards compare text; a reward file gets the value as stored.
    assert [t.ground_truth for t in source.tasks("train")] == ["3", "0.5", "true"]
    assert [t.truth for t in source.tasks("train")] == [3, 0.5, True]
    with pytest.raises(TaskDataError, match=r"'reward_model.ground_truth' is nan: give a "
                                            r"finite number"):
        JsonlTasks(write_jsonl(tmp_path / "b.jsonl", [verl_row(1, truth=float("nan"))]))


def test_a_single_file_is_the_train_split_and_asking_for_eval_names_the_rule(
    tmp_path: Path,
) -> None:
    source = load_task_source(str(write_jsonl(tmp_path / "data.jsonl", [verl_row(1)])), seed=0)
    assert len(source.tasks("train")) == 1
    with pytest.raises(TaskDataError, match=r"no eval split.*test\.<ext> or eval\.<ext>"):
        source.tasks("eval")


def test_missing_parquet_column_names_the_file_and_the_column(tmp_path: Path) -> None:
    rows = [{k: v for k, v in verl_row(1).items() if k != "reward_model"}]
    path = write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(TaskDataError, match=r"train\.parquet \(all rows\): column 'reward_model'"):
        load_task_source(str(tmp_path), seed=0)
    try:
        ParquetTasks(path)
    except TaskDataError as exc:
        assert exc.path == path and exc.field == "reward_model"


def test_missing_ground_truth_names_the_file_the_line_and_the_field(tmp_path: Path) -> None:
    bad = verl_row(2)
    bad["reward_model"] = {"style": "rule"}
    path = write_jsonl(tmp_path / "train.jsonl", [verl_row(1), bad])
    with pytest.raises(TaskDataError) as info:
        JsonlTasks(path)
    assert f"{path} line 2: field 'reward_model.ground_truth' is missing" in str(info.value)
    assert info.value.row == 2


def test_malformed_messages_name_the_message_and_key(tmp_path: Path) -> None:
    bad = verl_row(1)
    bad["prompt"] = [{"role": "user"}]
    path = write_jsonl(tmp_path / "train.jsonl", [bad])
    with pytest.raises(TaskDataError, match=r"line 1: field 'prompt\[0\]\.content' is None"):
        JsonlTasks(path)


def test_invalid_json_line_is_reported_with_its_line_number(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(verl_row(1)) + "\n\n{not json\n")
    with pytest.raises(TaskDataError, match=r"train\.jsonl line 3: not valid JSON"):
        JsonlTasks(path)


def test_repeated_index_is_refused_naming_both_rows(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "train.parquet", [verl_row(4), verl_row(5), verl_row(4)])
    with pytest.raises(
        TaskDataError, match=r"row 2: task id 'openai/gsm8k/train/4' repeats .*row 0"
    ):
        ParquetTasks(path)


def test_same_index_under_different_data_sources_gives_distinct_ids(tmp_path: Path) -> None:
    rows = [verl_row(1, source="a"), verl_row(1, source="b")]
    source = ParquetTasks(write_parquet(tmp_path / "train.parquet", rows))
    assert [t.task_id for t in source.tasks("train")] == ["a/train/1", "b/train/1"]


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["train.parquet", "test.parquet", "eval.parquet"], r"test\.parquet and eval\.parquet"),
        (["train.parquet", "train.jsonl"], r"both train\.parquet and train\.jsonl"),
        (["test.parquet"], r"no train\.parquet or train\.jsonl"),
    ],
)
def test_ambiguous_or_incomplete_directories_are_refused_with_the_rule(
    tmp_path: Path, names: list[str], message: str
) -> None:
    for name in names:
        if name.endswith(".parquet"):
            write_parquet(tmp_path / name, [verl_row(1)])
        else:
            write_jsonl(tmp_path / name, [verl_row(1)])
    with pytest.raises(TaskDataError, match=message):
        load_task_source(str(tmp_path), seed=0)


def test_nonexistent_path_and_unknown_suffix_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TaskDataError, match="neither builtin:reverse nor an existing"):
        load_task_source(str(tmp_path / "absent"), seed=0)
    (tmp_path / "tasks.csv").write_text("a,b\n")
    with pytest.raises(TaskDataError, match=r"suffix '\.csv': use \.parquet or \.jsonl"):
        load_task_source(str(tmp_path / "tasks.csv"), seed=0)


def test_empty_task_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text("\n")
    with pytest.raises(TaskDataError, match="has no rows"):
        load_task_source(str(tmp_path), seed=0)


def test_a_file_that_is_not_parquet_is_reported_as_unreadable(tmp_path: Path) -> None:
    (tmp_path / "train.parquet").write_bytes(b"definitely not parquet")
    with pytest.raises(TaskDataError, match="not a readable parquet file"):
        load_task_source(str(tmp_path), seed=0)


@pytest.mark.parametrize("seed", [0, 1, 2, 7, 42])
def test_builtin_eval_prompts_are_never_train_prompts(seed: int) -> None:
    # Drawn independently from one space, seed 0 gave 17 of 64 eval prompts
    # that were also train prompts: an eval of memorised answers.
    source = BuiltinReverseTasks(seed=seed, train_size=2048, eval_size=256)
    train = {t.prompt for t in source.tasks("train")}
    evaluated = {t.prompt for t in source.tasks("eval")}
    assert len(evaluated) > 100  # many distinct prompts, not one repeated
    assert not train & evaluated


def test_builtin_eval_prompts_are_outside_every_seeds_train_split() -> None:
    # The warm start trains on another seed's train split: the partition of
    # the prompt space must not depend on the seed.
    warm_train = {t.prompt for s in range(5)
                  for t in BuiltinReverseTasks(seed=1000 + s, train_size=1024).tasks("train")}
    run_eval = {t.prompt for t in BuiltinReverseTasks(seed=0).tasks("eval")}
    assert not warm_train & run_eval


def test_train_files_and_val_files_give_each_split_its_files_in_order(tmp_path: Path) -> None:
    # verl's data.train_files / data.val_files: parquet and JSONL mixed; rows without
    # extra_info.index are numbered across the split's files, so their ids never clash.
    first = write_parquet(tmp_path / "a" / "part-0.parquet", [verl_row(None), verl_row(None)])
    second = write_jsonl(tmp_path / "b" / "part-1.jsonl", [verl_row(None)])
    val = write_parquet(tmp_path / "val.parquet", [verl_row(3)])
    source = load_task_files([str(first), str(second)], [str(val)])
    assert [t.task_id for t in source.tasks("train")] == [
        f"openai/gsm8k/train/row-{i}" for i in range(3)]
    assert [t.task_id for t in source.tasks("eval")] == ["openai/gsm8k/eval/3"]
    assert source.files() == {"train": (first, second), "eval": (val,)}
    only_train = load_task_files([str(first)], [])
    with pytest.raises(TaskDataError, match=r"data\.train_files has no eval split"):
        only_train.tasks("eval")


def test_train_files_name_files_a_directory_or_another_suffix_is_refused(
        tmp_path: Path) -> None:
    write_parquet(tmp_path / "d" / "train.parquet", [verl_row(1)])
    (tmp_path / "dir.parquet").mkdir()
    with pytest.raises(TaskDataError, match=r"data.train_files names .* which is not a file "
                                            r"\(a directory with train and test files is "
                                            r"data.path\)"):
        load_task_files([str(tmp_path / "dir.parquet")], [])
    (tmp_path / "t.csv").write_text("a\n")
    with pytest.raises(TaskDataError, match=r"data.val_files names .*t.csv', whose suffix"):
        load_task_files([str(tmp_path / "d" / "train.parquet")], [str(tmp_path / "t.csv")])


def test_a_symlinked_train_file_is_followed(tmp_path: Path) -> None:
    real = write_jsonl(tmp_path / "store" / "gsm8k.jsonl", [verl_row(1)])
    link = tmp_path / "train.jsonl"
    link.symlink_to(real)
    (task,) = load_task_files([str(link)], []).tasks("train")
    assert task.task_id == "openai/gsm8k/train/1"


def test_any_json_ground_truth_and_extra_info_reach_the_task_as_stored(tmp_path: Path) -> None:
    truth = {"answer": 12, "units": ["apples"]}
    extra = {"index": 1, "split": "train", "tests": [{"in": "2", "out": "4"}], "gap": None}
    rows = [{**verl_row(1, truth=truth), "extra_info": extra}, verl_row(2, truth=7)]
    first, second = JsonlTasks(write_jsonl(tmp_path / "x.jsonl", rows)).tasks("train")
    assert first.truth == truth and first.extra_info == extra
    # The registered rewards compare text: an object's text is its canonical JSON.
    assert first.ground_truth == json.dumps(truth, sort_keys=True)
    assert second.truth == 7 and second.ground_truth == "7"
    made = BuiltinReverseTasks(seed=0).tasks("train")[0]
    assert made.truth == made.ground_truth and made.extra_info is None


def test_a_value_that_is_not_json_is_refused_naming_its_field(tmp_path: Path) -> None:
    import datetime

    row = {**verl_row(1), "extra_info": {"index": 1, "when": datetime.datetime(2026, 1, 1)}}
    with pytest.raises(TaskDataError, match=r"row 0: field 'extra_info.when' is a datetime: "
                                            r"task files hold JSON values"):
        ParquetTasks(write_parquet(tmp_path / "x.parquet", [row]))
