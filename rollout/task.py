"""The task record: one prompt with its reference answer, and where tasks come from.

rollout/tasks.py makes the built-in task and resolves data.path;
rollout/task_files.py reads task files in verl's layout.  Both build on this
record, which imports nothing of the project.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

# Chat messages as verl stores them: [{"role": "user", "content": "..."}].
Messages = tuple[tuple[tuple[str, str], ...], ...]

SPLITS: Final = ("train", "eval")


@dataclass(frozen=True, kw_only=True)
class Task:
    """One prompt with its reference answer.

    `prompt` is either plain text (sent as is) or a tuple of chat messages,
    each a tuple of (key, value) pairs, rendered with the model's chat
    template before generation.  Tuples keep the record hashable and frozen.
    `ground_truth` is the reference as text (a number written out), what the
    registered rewards compare with.  `stored_truth` and `extra_info` are the
    row's reward_model.ground_truth and extra_info exactly as the data holds
    them (any JSON value; read-only), what a reward file's compute_score gets;
    they are not part of equality or the hash (the task id is the identity).
    """

    task_id: str
    prompt: str | tuple[tuple[tuple[str, str], ...], ...]
    ground_truth: str
    data_source: str
    split: str
    stored_truth: Any = field(default=None, compare=False)  # None: ground_truth (tasks made in code)
    extra_info: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.task_id:
            raise ValueError("task_id is empty: every task needs a stable, unique id")
        if self.split not in SPLITS:
            raise ValueError(f"split {self.split!r} is not one of {SPLITS}")

    @property
    def truth(self) -> Any:
        """The ground truth as the data holds it (what compute_score gets)."""
        return self.ground_truth if self.stored_truth is None else self.stored_truth

    def messages(self) -> list[dict[str, str]] | None:
        """The prompt as chat messages, or None for a plain-text prompt."""
        if isinstance(self.prompt, str):
            return None
        return [dict(m) for m in self.prompt]


class TaskSource(Protocol):
    """Gives the tasks of a split, in a stable order with unique ids."""

    def tasks(self, split: str) -> Sequence[Task]: ...
