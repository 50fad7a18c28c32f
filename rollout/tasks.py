"""Task sources: where prompts and their ground truths come from.

Every task has a stable id, so that sharding, checkpoints and aggregation can
say exactly which tasks a rank owns, has finished or is missing.

Task files follow verl's layout (parquet or JSONL, one file per split); task
ids are derived from data_source, split and extra_info.index (or the row
number), so they survive re-reading the file on another node.

The built-in task is generated deterministically from a seed, so that a fresh
machine can run the whole loop with no data download: reverse a short string
of digits.  The answer depends on the prompt, a tiny model can learn it by RL
on a CPU, and exact match is an unambiguous reward.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from coordinator.fsio import open_regular
from rollout.errors import TaskDataError

# Chat messages as verl stores them: [{"role": "user", "content": "..."}].
Messages = tuple[tuple[tuple[str, str], ...], ...]

SPLITS: Final = ("train", "eval")


@dataclass(frozen=True, kw_only=True)
class Task:
    """One prompt with its reference answer.

    `prompt` is either plain text (sent as is) or a tuple of chat messages,
    each a tuple of (key, value) pairs, rendered with the model's chat
    template before generation.  Tuples keep the record hashable and frozen.
    """

    task_id: str
    prompt: str | tuple[tuple[tuple[str, str], ...], ...]
    ground_truth: str
    data_source: str
    split: str

    def __post_init__(self) -> None:
        if not self.task_id:
            raise ValueError("task_id is empty: every task needs a stable, unique id")
        if self.split not in SPLITS:
            raise ValueError(f"split {self.split!r} is not one of {SPLITS}")

    def messages(self) -> list[dict[str, str]] | None:
        """The prompt as chat messages, or None for a plain-text prompt."""
        if isinstance(self.prompt, str):
            return None
        return [dict(m) for m in self.prompt]


class TaskSource(Protocol):
    """Gives the tasks of a split, in a stable order with unique ids."""

    def tasks(self, split: str) -> Sequence[Task]: ...


# The digit-reversal task.  Prompt "4021>" asks for "1204"; the model ends its
# answer with its end-of-sequence token.
REVERSE_SOURCE: Final = "builtin/reverse"
REVERSE_SEPARATOR: Final = ">"
REVERSE_MIN_DIGITS: Final = 2
REVERSE_MAX_DIGITS: Final = 4
# The eval split draws from its own stream, and from its own part of the
# prompt space: a digit string belongs to eval when its hash falls in one
# eighth of the range, to train otherwise.  Independent draws from one space
# overlapped (seed 0: 17 of 64 eval prompts were train prompts); the partition
# is the same for every seed, so the warm start, which trains on another
# seed's train split, never sees an eval prompt either.
_SPLIT_SALT: Final = {"train": 0, "eval": 1_000_003}
EVAL_PART: Final = 8  # about 1 in 8 digit strings is an eval prompt: 11 of 100 with 2 digits


def reverse_split_of(digits: str) -> str:
    """The split a digit string's prompt belongs to, whatever the seed."""
    bucket = hashlib.blake2b(digits.encode(), digest_size=2).digest()[0] % EVAL_PART
    return "eval" if bucket == 0 else "train"


def reverse_prompt(digits: str) -> str:
    return f"{digits}{REVERSE_SEPARATOR}"


@dataclass(frozen=True, kw_only=True)
class BuiltinReverseTasks:
    """Deterministic digit-reversal tasks: the same seed gives the same tasks."""

    seed: int = 0
    train_size: int = 256
    eval_size: int = 64
    min_digits: int = REVERSE_MIN_DIGITS
    max_digits: int = REVERSE_MAX_DIGITS

    def __post_init__(self) -> None:
        if self.train_size < 1 or self.eval_size < 1:
            raise ValueError(
                f"train_size={self.train_size} and eval_size={self.eval_size} must be >= 1"
            )
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"digits range {self.min_digits}..{self.max_digits} is empty: "
                "need 1 <= min_digits <= max_digits"
            )

    def tasks(self, split: str) -> Sequence[Task]:
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is not one of {SPLITS}")
        size = self.train_size if split == "train" else self.eval_size
        rng = random.Random(self.seed * 7919 + _SPLIT_SALT[split])
        out = []
        for index in range(size):
            while True:
                length = rng.randint(self.min_digits, self.max_digits)
                digits = "".join(rng.choice("0123456789") for _ in range(length))
                if reverse_split_of(digits) == split:
                    break
            out.append(
                Task(
                    task_id=f"reverse/{split}/{index:06d}",
                    prompt=reverse_prompt(digits),
                    ground_truth=digits[::-1],
                    data_source=REVERSE_SOURCE,
                    split=split,
                )
            )
        return out


# --- Task files (verl layout) ------------------------------------------------
#
# A task file is one split; a directory holds the splits under fixed names.
# verl writes train.parquet and test.parquet; "eval" is accepted as the second
# name because that is what this project calls the split.
SPLIT_FILE_STEMS: Final = {"train": ("train",), "eval": ("test", "eval")}
SPLIT_RULE: Final = (
    "a task directory holds train.<ext> and optionally one of test.<ext> or eval.<ext> "
    "(ext = parquet or jsonl); a single task file is the train split only"
)
BUILTIN_PREFIX: Final = "builtin:"
_REQUIRED_FIELDS: Final = ("prompt", "reward_model", "data_source")


class _FileTasks:
    """Tasks read from one file per split, validated and indexed at construction.

    Everything is read up front so that a bad row stops the run at startup, on
    every rank alike, rather than in the middle of an eval many hours later.
    """

    suffix: str = ""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._files = _split_files(self.path, self.suffix)
        self._tasks = {
            split: _build_tasks(self._rows(file), file, split)
            for split, file in self._files.items()
        }

    def tasks(self, split: str) -> Sequence[Task]:
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is not one of {SPLITS}")
        if split not in self._tasks:
            raise TaskDataError(
                f"{self.path} has no {split} split: {SPLIT_RULE}",
                path=self.path,
            )
        return self._tasks[split]

    def files(self) -> Mapping[str, Path]:
        """The file each split was read from."""
        return dict(self._files)

    def _rows(self, file: Path) -> Iterator[tuple[str, int, Any]]:
        raise NotImplementedError


def _open_task_file(file: Path) -> int:
    """A descriptor of a task file: a regular file, never a FIFO or device that
    would block or never end (data.path comes from run.json, which others write).
    The path is the user's own (--data-path), not the run directory's: a symlink
    in it (a dataset kept elsewhere) is followed to the file it names."""
    return open_regular(Path(os.path.realpath(file)))


class ParquetTasks(_FileTasks):
    """verl-style parquet: prompt (chat messages), reward_model.ground_truth,
    data_source, optional extra_info.index."""

    suffix = ".parquet"

    def _rows(self, file: Path) -> Iterator[tuple[str, int, Any]]:
        import pyarrow.parquet as pq  # deferred: pyarrow is heavy and only file sources need it

        try:
            handle = os.fdopen(_open_task_file(file), "rb")
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
                        f"{sorted(names)}",
                        path=file,
                        field=name,
                    )
            columns = [*_REQUIRED_FIELDS, *(["extra_info"] if "extra_info" in names else [])]
            row = 0
            for batch in parquet.iter_batches(columns=columns, batch_size=4096):
                for record in batch.to_pylist():
                    yield f"{file} row {row}", row, record
                    row += 1


class JsonlTasks(_FileTasks):
    """One JSON object per line with the same fields as the parquet layout."""

    suffix = ".jsonl"

    def _rows(self, file: Path) -> Iterator[tuple[str, int, Any]]:
        try:
            handle = os.fdopen(_open_task_file(file), encoding="utf-8")
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
                        f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); "
                        "each line must be one JSON object",
                        path=file,
                        row=line_number,
                    ) from exc
                yield where, line_number, record


def load_task_source(spec: str, *, seed: int) -> TaskSource:
    """Resolve a task spec: "builtin:reverse", a task file, or a task directory.

    `seed` seeds generated sources only; file sources keep file order (the
    sharding step permutes tasks per iteration anyway).
    """
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX) :]
        if name != "reverse":
            raise TaskDataError(f"unknown built-in task source {spec!r}: known: builtin:reverse")
        return BuiltinReverseTasks(seed=seed)
    path = Path(spec)
    if path.is_dir():
        found = [
            cls for cls in (ParquetTasks, JsonlTasks) if (path / f"train{cls.suffix}").is_file()
        ]
        if len(found) != 1:
            what = (
                "both train.parquet and train.jsonl" if found else "no train.parquet or train.jsonl"
            )
            raise TaskDataError(f"task directory {path} has {what}: {SPLIT_RULE}", path=path)
        return found[0](path)
    if path.is_file():
        for cls in (ParquetTasks, JsonlTasks):
            if path.suffix == cls.suffix:
                return cls(path)
        raise TaskDataError(
            f"task file {path} has suffix {path.suffix!r}: use .parquet or .jsonl", path=path
        )
    raise TaskDataError(
        f"task source {spec!r} is neither builtin:reverse nor an existing file or directory",
        path=path,
    )


def _split_files(path: Path, suffix: str) -> dict[str, Path]:
    if path.is_file():
        if path.suffix != suffix:
            raise TaskDataError(f"task file {path} does not end in {suffix}", path=path)
        return {"train": path}
    if not path.is_dir():
        raise TaskDataError(f"task path {path} does not exist: {SPLIT_RULE}", path=path)
    files: dict[str, Path] = {}
    for split, stems in SPLIT_FILE_STEMS.items():
        present = [
            path / f"{stem}{suffix}" for stem in stems if (path / f"{stem}{suffix}").is_file()
        ]
        if len(present) > 1:
            raise TaskDataError(
                f"{path} has {' and '.join(p.name for p in present)} for the {split} split: "
                f"keep only one; {SPLIT_RULE}",
                path=path,
            )
        if present:
            files[split] = present[0]
    if "train" not in files:
        raise TaskDataError(f"{path} has no train{suffix}: {SPLIT_RULE}", path=path)
    return files


def _build_tasks(rows: Iterator[tuple[str, int, Any]], file: Path, split: str) -> tuple[Task, ...]:
    tasks: list[Task] = []
    first_seen: dict[str, str] = {}
    for position, (where, row, record) in enumerate(rows):
        task = _task_from_record(
            record, where=where, file=file, row=row, position=position, split=split
        )
        if task.task_id in first_seen:
            raise TaskDataError(
                f"{where}: task id {task.task_id!r} repeats {first_seen[task.task_id]}; "
                "make extra_info.index unique per data_source",
                path=file,
                row=row,
                field="extra_info.index",
            )
        first_seen[task.task_id] = where
        tasks.append(task)
    if not tasks:
        raise TaskDataError(f"task file {file} has no rows: give at least one task", path=file)
    return tuple(tasks)


def _task_from_record(
    record: Any, *, where: str, file: Path, row: int, position: int, split: str
) -> Task:
    def fail(field: str, problem: str) -> TaskDataError:
        return TaskDataError(f"{where}: field {field!r} {problem}", path=file, row=row, field=field)

    if not isinstance(record, Mapping):
        raise fail(
            "<row>", f"is a {type(record).__name__}, expected an object with {_REQUIRED_FIELDS}"
        )
    for name in _REQUIRED_FIELDS:
        if record.get(name) is None:
            raise fail(name, "is missing")
    data_source = record["data_source"]
    if not isinstance(data_source, str) or not data_source:
        raise fail("data_source", f"is {data_source!r}: give a non-empty string")
    reward_model = record["reward_model"]
    if not isinstance(reward_model, Mapping) or reward_model.get("ground_truth") is None:
        raise fail(
            "reward_model.ground_truth", "is missing: reward_model must be {ground_truth: ...}"
        )
    truth = reward_model["ground_truth"]
    # Numbers are common in math sets; bools are not answers but int subclasses.
    if isinstance(truth, bool) or not isinstance(truth, str | int | float):
        raise fail(
            "reward_model.ground_truth", f"is a {type(truth).__name__}: give a string or number"
        )
    extra = record.get("extra_info")
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
        ground_truth=str(truth),
        data_source=data_source,
        split=split,
    )


def _prompt(
    value: Any, fail: Callable[[str, str], TaskDataError]
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
            raise fail(f"prompt[{i}]", f"is a {type(message).__name__}, expected {{role, content}}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise fail(f"prompt[{i}].{key}", f"is {message.get(key)!r}: give a string")
        messages.append((("role", message["role"]), ("content", message["content"])))
    return tuple(messages)
