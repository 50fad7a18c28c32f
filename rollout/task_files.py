"""Task files in verl's layout: parquet or JSONL, one row per prompt.

    data.path = "builtin:reverse"     the generated task (rollout/tasks.py, which
                                      resolves data.path: load_task_source)
    data.path = DIR                   DIR/train.<ext>, and optionally DIR/test.<ext>
                                      or DIR/eval.<ext> for the eval split
    data.path = FILE                  FILE is the train split; there is no eval split
    data.train_files = F | [F, ...]   verl's way: the train split is these files, in
    data.val_files   = F | [F, ...]   order, and the eval split these (none: no eval
                                      split)

    a row    data_source   a non-empty string
             prompt        text, or chat messages [{role, content}, ...]
             reward_model  {ground_truth: any JSON value, ...}
             extra_info    optional, any JSON value; extra_info.index names the task
             (ability and any other column: ignored)

Task ids are data_source/split/index (extra_info.index, else the row's
position in its split), so they survive re-reading the files on another node.
Everything is read and checked when the source is made, so that a bad row
stops the run at start, on every rank alike, rather than in the middle of an
eval hours later.  A task file is opened as a regular file only (never a FIFO
or a device that would block); the paths are the user's own, so a symlink in
them (a dataset kept elsewhere) is followed.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from coordinator.storage.fsio import open_regular
from rollout.errors import TaskDataError
from rollout.task import SPLITS, Task

# verl writes train.parquet and test.parquet; "eval" is accepted as the second
# name because that is what this project calls the split.
SPLIT_FILE_STEMS: Final = {"train": ("train",), "eval": ("test", "eval")}
SUFFIXES: Final = (".parquet", ".jsonl")
SPLIT_RULE: Final = (
    "a task directory holds train.<ext> and optionally one of test.<ext> or eval.<ext> "
    "(ext = parquet or jsonl); a single task file is the train split only; "
    "data.train_files and data.val_files name each split's files"
)
_REQUIRED_FIELDS: Final = ("prompt", "reward_model", "data_source")

Row = tuple[str, int, Any]  # where (for messages), row or line number, the record


class FileTasks:
    """Tasks read from files, per split, validated and indexed at construction."""

    def __init__(self, files: Mapping[str, Sequence[Path]], *, where: str) -> None:
        self.where = where
        self._files = {split: tuple(Path(f) for f in found) for split, found in files.items()
                       if found}
        self._tasks = {split: _build_tasks(found, split) for split, found in self._files.items()}

    def tasks(self, split: str) -> Sequence[Task]:
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is not one of {SPLITS}")
        if split not in self._tasks:
            raise TaskDataError(f"{self.where} has no {split} split: {SPLIT_RULE}",
                                path=Path(self.where))
        return self._tasks[split]

    def files(self) -> Mapping[str, tuple[Path, ...]]:
        """The files each split was read from, in order."""
        return dict(self._files)


class _LayoutTasks(FileTasks):
    """A task directory (train.<suffix>, test.<suffix>), or one file of `suffix`."""

    suffix: str = ""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        super().__init__({split: [file] for split, file in
                          _split_files(self.path, self.suffix).items()}, where=str(self.path))


class ParquetTasks(_LayoutTasks):
    suffix = ".parquet"


class JsonlTasks(_LayoutTasks):
    suffix = ".jsonl"


def load_task_files(train: Sequence[str], val: Sequence[str]) -> FileTasks:
    """data.train_files and data.val_files: each a list of parquet or JSONL files."""
    files: dict[str, list[Path]] = {}
    for split, setting, paths in (("train", "data.train_files", train),
                                  ("eval", "data.val_files", val)):
        for given in paths:
            path = Path(given)
            if path.suffix not in SUFFIXES:
                raise TaskDataError(f"{setting} names {given!r}, whose suffix is not .parquet "
                                    "or .jsonl: give task files", path=path)
            if not path.is_file():
                raise TaskDataError(
                    f"{setting} names {given!r}, which is not a file"
                    + (" (a directory with train and test files is data.path)"
                       if path.is_dir() else ""), path=path)
            files.setdefault(split, []).append(path)
    if "train" not in files:
        raise TaskDataError("data.train_files is empty: give at least one task file",
                            path=Path("."))
    return FileTasks(files, where="data.train_files")


def _split_files(path: Path, suffix: str) -> dict[str, Path]:
    if path.is_file():
        if path.suffix != suffix:
            raise TaskDataError(f"task file {path} does not end in {suffix}", path=path)
        return {"train": path}
    if not path.is_dir():
        raise TaskDataError(f"task path {path} does not exist: {SPLIT_RULE}", path=path)
    files: dict[str, Path] = {}
    for split, stems in SPLIT_FILE_STEMS.items():
        present = [path / f"{stem}{suffix}" for stem in stems
                   if (path / f"{stem}{suffix}").is_file()]
        if len(present) > 1:
            raise TaskDataError(
                f"{path} has {' and '.join(p.name for p in present)} for the {split} split: "
                f"keep only one; {SPLIT_RULE}", path=path)
        if present:
            files[split] = present[0]
    if "train" not in files:
        raise TaskDataError(f"{path} has no train{suffix}: {SPLIT_RULE}", path=path)
    return files


# --- reading rows ------------------------------------------------------------------


def _open(file: Path) -> int:
    """A descriptor of a task file: a regular file, never a FIFO or device that would
    block or never end (data.path comes from run.json, which others write).  The
    path is the user's own, not the run directory's: a symlink in it is followed."""
    return open_regular(Path(os.path.realpath(file)))


def _parquet_rows(file: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq  # deferred: pyarrow is heavy and only file sources need it

    try:
        handle = os.fdopen(_open(file), "rb")
    except (OSError, ValueError) as exc:
        raise TaskDataError(f"cannot open task file {file}: {exc}", path=file) from exc
    with handle:
        try:
            parquet = pq.ParquetFile(handle)
        except (OSError, ValueError) as exc:  # pyarrow raises ArrowInvalid (a ValueError)
            raise TaskDataError(f"{file} is not a readable parquet file: {exc}",
                                path=file) from exc
        names = set(parquet.schema_arrow.names)
        for name in _REQUIRED_FIELDS:
            if name not in names:
                raise TaskDataError(
                    f"{file} (all rows): column {name!r} is missing; verl task files need "
                    f"columns {', '.join(_REQUIRED_FIELDS)} (extra_info optional), found "
                    f"{sorted(names)}", path=file, field=name)
        columns = [*_REQUIRED_FIELDS, *(["extra_info"] if "extra_info" in names else [])]
        row = 0
        for batch in parquet.iter_batches(columns=columns, batch_size=4096):
            for record in batch.to_pylist():
                yield f"{file} row {row}", row, record
                row += 1


def _jsonl_rows(file: Path) -> Iterator[Row]:
    try:
        handle = os.fdopen(_open(file), encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise TaskDataError(f"cannot open task file {file}: {exc}", path=file) from exc
    with handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{file} line {line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskDataError(
                    f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line "
                    "must be one JSON object", path=file, row=line_number) from exc
            yield where, line_number, record


_READERS: Final[Mapping[str, Callable[[Path], Iterator[Row]]]] = {
    ".parquet": _parquet_rows, ".jsonl": _jsonl_rows}


def _build_tasks(files: Sequence[Path], split: str) -> tuple[Task, ...]:
    """A split's tasks from its files, in order; positions count across the files."""
    tasks: list[Task] = []
    first_seen: dict[str, str] = {}
    for file in files:
        read = _READERS.get(file.suffix)
        if read is None:
            raise TaskDataError(f"task file {file} has suffix {file.suffix!r}: use .parquet or "
                                ".jsonl", path=file)
        before = len(tasks)
        for where, row, record in read(file):
            task = _task_from_record(record, where=where, file=file, row=row,
                                     position=len(tasks), split=split)
            if task.task_id in first_seen:
                raise TaskDataError(
                    f"{where}: task id {task.task_id!r} repeats {first_seen[task.task_id]}; "
                    "make extra_info.index unique per data_source", path=file, row=row,
                    field="extra_info.index")
            first_seen[task.task_id] = where
            tasks.append(task)
        if len(tasks) == before:
            raise TaskDataError(f"task file {file} has no rows: give at least one task",
                                path=file)
    return tuple(tasks)


def _task_from_record(record: Any, *, where: str, file: Path, row: int, position: int,
                      split: str) -> Task:
    def fail(field: str, problem: str) -> TaskDataError:
        return TaskDataError(f"{where}: field {field!r} {problem}", path=file, row=row,
                             field=field)

    if not isinstance(record, Mapping):
        raise fail("<row>", f"is a {type(record).__name__}, expected an object with "
                   f"{_REQUIRED_FIELDS}")
    for name in _REQUIRED_FIELDS:
        if record.get(name) is None:
            raise fail(name, "is missing")
    data_source = record["data_source"]
    if not isinstance(data_source, str) or not data_source:
        raise fail("data_source", f"is {data_source!r}: give a non-empty string")
    reward_model = record["reward_model"]
    if not isinstance(reward_model, Mapping) or reward_model.get("ground_truth") is None:
        raise fail("reward_model.ground_truth",
                   "is missing: reward_model must be {ground_truth: ...}")
    truth = reward_model["ground_truth"]
    _check_json(truth, "reward_model.ground_truth", fail, finite=True)
    extra = record.get("extra_info")
    _check_json(extra, "extra_info", fail, finite=False)
    index = extra.get("index") if isinstance(extra, Mapping) else None
    if index is None:
        local_id = f"row-{position}"
    elif isinstance(index, bool) or not isinstance(index, int | str) or index == "":
        raise fail("extra_info.index", f"is {index!r}: give an integer or non-empty string")
    else:
        local_id = str(index)
    return Task(
        task_id=f"{data_source}/{split}/{local_id}",
        prompt=_prompt(record["prompt"], fail),
        ground_truth=truth if isinstance(truth, str) else
        str(truth) if isinstance(truth, int | float) and not isinstance(truth, bool) else
        json.dumps(truth, sort_keys=True, ensure_ascii=False),
        data_source=data_source,
        split=split,
        stored_truth=truth,
        extra_info=extra,
    )


def _check_json(value: Any, field: str, fail: Callable[[str, str], TaskDataError], *,
                finite: bool) -> None:
    """Every part of `value` is a JSON value: what a reward file's worker is sent.
    `finite`: refuse NaN (kept in extra_info, where pandas writes a missing value so)."""
    if value is None or isinstance(value, str | bool | int):
        return
    if isinstance(value, float):
        if finite and not math.isfinite(value):
            raise fail(field, f"is {value}: give a finite number")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise fail(field, f"has the key {key!r}: JSON object keys are strings")
            _check_json(item, f"{field}.{key}", fail, finite=finite)
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_json(item, f"{field}[{i}]", fail, finite=finite)
        return
    raise fail(field, f"is a {type(value).__name__}: task files hold JSON values (strings, "
               "numbers, booleans, null, lists, objects)")


def _prompt(value: Any, fail: Callable[[str, str], TaskDataError]
            ) -> str | tuple[tuple[tuple[str, str], ...], ...]:
    if isinstance(value, str):
        if not value:
            raise fail("prompt", "is an empty string")
        return value
    if not isinstance(value, list | tuple) or not value:
        raise fail("prompt", "must be a non-empty list of chat messages {role, content}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise fail(f"prompt[{i}]", f"is a {type(message).__name__}, expected "
                       "{role, content}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise fail(f"prompt[{i}].{key}", f"is {message.get(key)!r}: give a string")
        messages.append((("role", message["role"]), ("content", message["content"])))
    return tuple(messages)
