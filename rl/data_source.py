"""The tasks a run's [data] names, and what a run without eval data does.

    data.path = builtin:reverse | FILE | DIR    (rollout/task_files.py)
    data.train_files = [F, ...], data.val_files = [F, ...]    verl's way
    (both data.path and data.train_files: refused at start, rl/config.py)

No eval data is what a single train file, a task directory without test.<ext>,
or data.train_files without data.val_files give.  Such a run goes on without
eval rather than being refused: when the config leaves the eval schedule to
its defaults, resolving it sets schedule.eval_interval = 0 and
schedule.eval_before_train = false (so run.json and `coordinator status` say
what happens) and logs a WARNING saying so.  A config that asks for eval
(sets either key, or schedule.rollout_split = "eval-only") keeps it, and the
settings check at phase 0 refuses the run naming the missing split
(rl/preflight.py), since the user asked for something the data cannot give.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final, Protocol

from rollout.task_files import load_task_files
from rollout.tasks import BUILTIN_REVERSE, TaskSource, eval_data_of, load_task_source

log = logging.getLogger(__name__)

# The schedule's keys that ask for eval: a config giving either keeps its eval.
EVAL_KEYS: Final = ("eval_interval", "eval_before_train")
EVAL_ONLY: Final = "eval-only"


class DataSettings(Protocol):
    """What task_source reads of the [data] section (rl/config.py DataSection)."""

    @property
    def path(self) -> str: ...
    @property
    def train_files(self) -> str | tuple[str, ...]: ...
    @property
    def val_files(self) -> str | tuple[str, ...]: ...
    @property
    def seed(self) -> int: ...


def task_source(data: DataSettings) -> TaskSource:
    """The tasks data.train_files/val_files or data.path name, every row read."""
    if data.train_files:
        return load_task_files(_paths(data.train_files), _paths(data.val_files))
    return load_task_source(data.path, seed=data.seed)


def _paths(value: str | tuple[str, ...]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def has_eval_data(data: Mapping[str, Any]) -> bool | None:
    """Whether raw [data] settings give an eval split; None where data.path names
    nothing that exists (phase 0 reports that)."""
    train, val = data.get("train_files"), data.get("val_files")
    if train:
        return bool(val)
    path = data.get("path", BUILTIN_REVERSE)
    return eval_data_of(path) if isinstance(path, str) else None


def without_eval_data(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """Raw sections with eval off when their data gives no eval split and the config
    does not ask for eval; `raw` unchanged otherwise.  Logs a WARNING when it turns
    eval off."""
    schedule = raw.get("schedule", {})
    data = raw.get("data", {})
    if not isinstance(schedule, Mapping) or not isinstance(data, Mapping):
        return raw  # parsing says what is wrong
    if any(k in schedule for k in EVAL_KEYS) or schedule.get("rollout_split") == EVAL_ONLY:
        return raw
    if has_eval_data(data) is not False:
        return raw
    given = ("data.train_files without data.val_files" if data.get("train_files")
             else f"data.path={data.get('path')!r} has no eval split")
    log.warning("no validation data (%s): the run does not evaluate (schedule.eval_interval=0, "
                "schedule.eval_before_train=false); give data.val_files (or a test.<ext> "
                "beside train.<ext>) to evaluate", given)
    return {**raw, "schedule": {**schedule, "eval_interval": 0, "eval_before_train": False}}
