"""Task sources: where prompts and their ground truths come from.

Every task has a stable id, so that sharding, checkpoints and aggregation can
say exactly which tasks a rank owns, has finished or is missing.

Task files follow verl's layout (parquet or JSONL: rollout/task_files.py);
task ids are derived from data_source, split and extra_info.index (or the row
number), so they survive re-reading the file on another node.

The built-in task is generated deterministically from a seed, so that a fresh
machine can run the whole loop with no data download: reverse a short string
of digits.  The answer depends on the prompt, a tiny model can learn it by RL
on a CPU, and exact match is an unambiguous reward.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from rollout.errors import TaskDataError
from rollout.task import SPLITS, Messages, Task, TaskSource
from rollout.task_files import SPLIT_FILE_STEMS, SPLIT_RULE, SUFFIXES, JsonlTasks, ParquetTasks

__all__ = [
    "SPLITS",
    "BuiltinReverseTasks",
    "Messages",
    "Task",
    "TaskSource",
    "eval_data_of",
    "load_task_source",
]

# The digit-reversal task.  Prompt "4021>" asks for "1204"; the model ends its
# answer with its end-of-sequence token.
REVERSE_SOURCE: Final = "builtin/reverse"
BUILTIN_PREFIX: Final = "builtin:"
BUILTIN_REVERSE: Final = f"{BUILTIN_PREFIX}reverse"  # data.path's default
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
    """Deterministic digit-reversal tasks: the same seed gives the same tasks.

    `chat`: each prompt is one user message holding the same text, for a model
    prompted through its chat template (rl/loop.py decides); the ids, answers and
    splits are those of the text form."""

    seed: int = 0
    train_size: int = 256
    eval_size: int = 64
    min_digits: int = REVERSE_MIN_DIGITS
    max_digits: int = REVERSE_MAX_DIGITS
    chat: bool = False

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
                    prompt=((("role", "user"), ("content", reverse_prompt(digits))),)
                    if self.chat else reverse_prompt(digits),
                    ground_truth=digits[::-1],
                    data_source=REVERSE_SOURCE,
                    split=split,
                )
            )
        return out


# --- data.path -------------------------------------------------------------------


def load_task_source(spec: str, *, seed: int) -> TaskSource:
    """data.path: "builtin:reverse", a task file, or a task directory.

    `seed` seeds generated sources only; file sources keep file order (the
    sharding step permutes tasks per iteration anyway).
    """
    if spec.startswith(BUILTIN_PREFIX):
        if spec != BUILTIN_REVERSE:
            raise TaskDataError(f"unknown built-in task source {spec!r}: known: "
                                f"{BUILTIN_REVERSE}")
        return BuiltinReverseTasks(seed=seed)
    path = Path(spec)
    if path.is_dir():
        found = [cls for cls in (ParquetTasks, JsonlTasks)
                 if (path / f"train{cls.suffix}").is_file()]
        if len(found) != 1:
            what = ("both train.parquet and train.jsonl" if found
                    else "no train.parquet or train.jsonl")
            raise TaskDataError(f"task directory {path} has {what}: {SPLIT_RULE}", path=path)
        return found[0](path)
    if path.is_file():
        for cls in (ParquetTasks, JsonlTasks):
            if path.suffix == cls.suffix:
                return cls(path)
        raise TaskDataError(
            f"task file {path} has suffix {path.suffix!r}: use .parquet or .jsonl", path=path)
    raise TaskDataError(
        f"task source {spec!r} is neither {BUILTIN_REVERSE} nor an existing file or directory",
        path=path)


def eval_data_of(spec: str) -> bool | None:
    """Whether data.path gives an eval split (None: it names nothing that exists; the
    settings check at phase 0 says so)."""
    if spec.startswith(BUILTIN_PREFIX):
        return True
    path = Path(spec)
    if path.is_file():
        return False
    if not path.is_dir():
        return None
    return any((path / f"{stem}{suffix}").is_file()
               for stem in SPLIT_FILE_STEMS["eval"] for suffix in SUFFIXES)
