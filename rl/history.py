"""What each iteration of a run did, from the metrics the master published.

    iterations/<N>/metrics/rollout.json   samples rolled out, failed, kept in the batch,
                                          train reward
    iterations/<N>/metrics/eval.json      eval samples, failed, accuracy
    iterations/<N>/metrics/train.json     samples the trainer trained on, loss

    records(run_dir, iterations)   one IterationRecord per iteration (None where a
                                   metrics file is not there yet), each file read once
    report(run_dir, iterations)    the rows `coordinator status` shows
    summarize(run_dir, config)     the line each daemon ends with, and whether the
                                   run learned: exit 0 only if every iteration trained
                                   on a batch within rollout.max_failed_fraction

Files written by the master on another node are read like every shared record
(coordinator.storage.store.read_document); a missing or unreadable one is shown as
unknown, never as zero.  The summary a daemon exits with retries a failed
read for up to SUMMARY_READ_S before it counts the file as unreadable (and
names it): a transient EIO at the end of a good run is not a failed run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from coordinator.config.run_config import RunConfig
from coordinator.machine.actions import RunSummary
from coordinator.records.phases import Phase
from coordinator.storage.store import read_document
from rl import layout
from rl.schedule import RolloutSplit, schedule_of

_SPLIT_FILES: Final = ("rollout.json", "eval.json")  # each holds one split's counts


@dataclasses.dataclass(frozen=True, kw_only=True)
class IterationRecord:
    iteration: int
    rolled_out: int | None = None  # train samples generated
    batch: int | None = None  # of those, kept in the train batch
    trained: int | None = None  # samples the trainer reports it trained on
    train_failed: int | None = None
    eval_failed: int | None = None
    reward_mean: float | None = None
    eval_accuracy: float | None = None
    loss: float | None = None
    staleness_max: int | None = None  # policy versions the batch's oldest sample lags
    # Reward calls that ran out of time and scored 0 (rollout/reward_tally.py).
    train_reward_timeouts: int | None = None
    eval_reward_timeouts: int | None = None
    unreadable: tuple[Unreadable, ...] = ()  # files there but unreadable within the deadline

    @property
    def failed(self) -> int | None:
        """Failed samples, train and eval; None when neither is known, or when
        rollout.json or eval.json is there but unreadable (its share is unknown: the
        other's alone is no total)."""
        return self._total(self.train_failed, self.eval_failed)

    @property
    def reward_timeouts(self) -> int | None:
        """Reward calls that timed out, train and eval; None as for `failed`."""
        return self._total(self.train_reward_timeouts, self.eval_reward_timeouts)

    def _total(self, train: int | None, evaluation: int | None) -> int | None:
        if any(u.path.name in _SPLIT_FILES for u in self.unreadable):
            return None
        known = [n for n in (train, evaluation) if n is not None]
        return sum(known) if known else None

    def row(self) -> dict[str, Any]:
        """For `coordinator status`: the columns people look at first."""
        return {"iteration": self.iteration, "train_samples": self.trained,
                "failed_samples": self.failed, "rollout_samples": self.rolled_out,
                "reward_mean": self.reward_mean, "eval_accuracy": self.eval_accuracy,
                "staleness_max": self.staleness_max, "reward_timeouts": self.reward_timeouts}


# How long the end-of-run summary keeps retrying a metrics file that fails to
# read (EIO, ESTALE, a throttled GET): an NFS server failover or a bucket's
# throttling lasts seconds to a minute, and a finished run must not turn into
# exit 4 over it.  The deadline is for the whole summary, not per file.
SUMMARY_READ_S: Final = 120.0
# `coordinator status` is interactive: one second per file, then unknown.
STATUS_READ_S: Final = 1.0


@dataclasses.dataclass(frozen=True)
class Unreadable:
    """A metrics file that exists but could not be read within the deadline."""

    path: Path
    error: str


def read_checked(path: Path, *, retry_s: float = STATUS_READ_S,
                 sleep: Callable[[float], None] = time.sleep) -> dict[str, Any] | Unreadable | None:
    """A JSON object another node published; None when absent, Unreadable when
    it could not be read or is not an object after read_document's retries of a
    torn, stale or failed read (for `retry_s`)."""
    try:
        data = read_document(path, lambda raw, _where: json.loads(raw), retry_s=retry_s,
                             sleep=sleep)
    except (OSError, ValueError) as exc:
        return Unreadable(path, f"{type(exc).__name__}: {exc}")
    if data is None or isinstance(data, dict):
        return data
    return Unreadable(path, f"holds a JSON {type(data).__name__}, not an object")


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object another node published, for display: None when absent or
    unreadable within STATUS_READ_S."""
    data = read_checked(path)
    return None if isinstance(data, Unreadable) else data


def read_metrics(run_dir: Path, iteration: int, name: str) -> dict[str, Any] | None:
    """An iteration's metrics file ("rollout", "eval" or "train"), for display;
    None when absent or unreadable."""
    return read_json(layout.metrics(run_dir, iteration, name))


def _number(data: Mapping[str, Any] | None, key: str) -> float | None:
    value = data.get(key) if data is not None else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _count(data: Mapping[str, Any] | None, key: str) -> int | None:
    value = _number(data, key)
    return int(value) if value is not None and value >= 0 else None


class _Reader:
    """Reads metrics files, each retried for at most `per_file_s` and all of them
    within `deadline_s` of this reader's start."""

    def __init__(self, deadline_s: float = math.inf, *, per_file_s: float = math.inf,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_file_s = per_file_s
        self.sleep = sleep
        self.clock = clock
        self.until = clock() + deadline_s

    def __call__(self, run_dir: Path, iteration: int, name: str
                 ) -> dict[str, Any] | Unreadable | None:
        left = min(self.per_file_s, max(0.0, self.until - self.clock()))
        return read_checked(layout.metrics(run_dir, iteration, name), retry_s=left,
                            sleep=self.sleep)


def record(run_dir: Path, iteration: int, *, reader: _Reader | None = None) -> IterationRecord:
    read = reader or _Reader(per_file_s=STATUS_READ_S)
    files = {name: read(run_dir, iteration, name) for name in ("rollout", "eval", "train")}
    unreadable = tuple(f for f in files.values() if isinstance(f, Unreadable))
    rollout, evaluation, train = (None if isinstance(f, Unreadable) else f
                                  for f in files.values())
    return IterationRecord(
        iteration=iteration, rolled_out=_count(rollout, "num_samples"),
        batch=_count(rollout, "num_train_samples"), trained=_count(train, "samples"),
        train_failed=_count(rollout, "num_failed"), eval_failed=_count(evaluation, "num_failed"),
        reward_mean=_number(rollout, "reward_mean"),
        eval_accuracy=_number(evaluation, "accuracy"), loss=_number(train, "loss"),
        staleness_max=_count(rollout, "staleness_max"),
        train_reward_timeouts=_count(rollout, "reward_timeouts"),
        eval_reward_timeouts=_count(evaluation, "reward_timeouts"), unreadable=unreadable)


def records(run_dir: Path, iterations: int, *, reader: _Reader | None = None
            ) -> list[IterationRecord]:
    """Each iteration's record, each metrics file read once."""
    read = reader or _Reader(per_file_s=STATUS_READ_S)
    return [record(run_dir, it, reader=read) for it in range(iterations)]


def report(run_dir: Path, iterations: int) -> list[dict[str, Any]]:
    """`coordinator status`: a row per iteration that has started to leave metrics,
    with whether its checkpoint is there ("kept", or "best (<value>)" for the one
    checkpoint.keep_best keeps, rl/keep_best.py)."""
    from rl.keep_best import checkpoint_states

    states = checkpoint_states(run_dir)
    return [r.row() | {"checkpoint": states.get(r.iteration)} for r in records(run_dir, iterations)
            if any(v is not None for v in (r.rolled_out, r.trained, r.eval_accuracy))]


def _trains(config: RunConfig) -> bool:
    schedule = schedule_of(config.sections)
    return schedule.trains and Phase.TRAIN in schedule.rl_phase.phases


def _problem(r: IterationRecord, config: RunConfig, fraction: float) -> str | None:
    """Why iteration `r` did not learn as asked, or None."""
    if not _trains(config):
        return None
    if r.unreadable:
        return "; ".join(f"{u.path} could not be read ({u.error})" for u in r.unreadable)
    if Phase.AGGREGATE in schedule_of(config.sections).rl_phase.phases:
        if r.rolled_out is None or r.batch is None or r.train_failed is None:
            return "no rollout metrics"
        if not r.batch:
            return "an empty train batch"
        if r.train_failed > fraction * r.rolled_out:
            return (f"{r.train_failed} of {r.rolled_out} samples failed (limit "
                    f"rollout.max_failed_fraction={fraction:g})")
    if not r.trained:
        return "no samples trained" if r.trained == 0 else "no training metrics"
    return None


def summarize(run_dir: Path, config: RunConfig, *, deadline_s: float = SUMMARY_READ_S,
              sleep: Callable[[float], None] = time.sleep,
              clock: Callable[[], float] = time.monotonic) -> RunSummary:
    """What the run did, for each daemon's last line, and why it did not learn.

    Each metrics file is read once; a read that fails (EIO, ESTALE, a throttled
    GET) is retried until `deadline_s` after the first, shared by every file,
    and only then counts against the run, naming the file and the error."""
    from rl.config import parse_sections

    fraction = parse_sections(config.sections).rollout.max_failed_fraction
    found = records(run_dir, config.run.iterations,
                    reader=_Reader(deadline_s, sleep=sleep, clock=clock))
    trained = sum(r.trained or 0 for r in found)
    failed = sum(r.failed or 0 for r in found)
    text = f"{trained} samples trained, {failed} failed"
    problems = [f"iteration {r.iteration}: {p}" for r in found
                if (p := _problem(r, config, fraction)) is not None]
    if not _trains(config):
        text += " (no training asked: " + ("eval only" if schedule_of(config.sections)
                                           .rollout_split is RolloutSplit.EVAL_ONLY
                                           else "rollout only") + ")"
    return RunSummary(text=text, problem="; ".join(problems[:5]) + (
        f" (and {len(problems) - 5} more)" if len(problems) > 5 else "") if problems else None)
