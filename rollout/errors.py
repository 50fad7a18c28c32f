"""The rollout package's exceptions: one root, one subclass per kind of failure.

Every error names the offending value, the rule it broke and the fix, and
carries the facts (path, rank, row) as attributes so callers can act on them
without parsing messages.  Subclasses also derive from the built-in that fits,
so `except ValueError` keeps working for callers that predate this package.

A file on disk that does not match its schema (rank manifest, shard plan,
chunk, training batch) is reported with coordinator's MalformedRecordError,
the one type every daemon already maps to the CORRUPT exit code.
"""

from __future__ import annotations

from pathlib import Path


class RolloutError(Exception):
    """Root of every error raised by the rollout package."""


class TaskDataError(RolloutError, ValueError):
    """A task file or task spec is missing, malformed or ambiguous."""

    def __init__(
        self,
        message: str,
        *,
        path: Path | None = None,
        row: int | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.row = row
        self.field = field


class UnknownRewardError(RolloutError, LookupError):
    """A reward name or data source has no registered reward function."""

    def __init__(self, message: str, *, name: str, known: tuple[str, ...]) -> None:
        super().__init__(message)
        self.name = name
        self.known = known

    def __str__(self) -> str:
        # LookupError/KeyError would repr() the message; keep it readable.
        return str(self.args[0])


class RewardFileError(UnknownRewardError):
    """reward.path cannot be used here: the message names the file, the rule and the fix."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message, name=path, known=())
        self.path = path


class ShardingError(RolloutError, ValueError):
    """Weights or task ids cannot be split into a valid shard plan."""


class CheckpointError(RolloutError):
    """A rank checkpoint directory cannot be used as asked."""

    def __init__(self, message: str, *, path: Path | None = None, rank: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.rank = rank


class AggregationError(RolloutError):
    """The ranks' outputs for an iteration are incomplete, inconsistent or unsafe."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        path: Path | None = None,
        missing: tuple[str, ...] = (),
        duplicated: tuple[str, ...] = (),
        foreign: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.path = path
        self.missing = missing
        self.duplicated = duplicated
        self.foreign = foreign


class BudgetError(RolloutError, ValueError):
    """A rollout lost more than its settings allow: too many failed samples, or a
    train batch too small to learn from (rollout/budget.py)."""

    def __init__(self, message: str, *, setting: str, value: float, limit: float) -> None:
        super().__init__(message)
        self.setting, self.value, self.limit = setting, value, limit
