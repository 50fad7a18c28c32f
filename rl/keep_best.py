"""Which checkpoints phase 13 keeps: the newest `checkpoint.keep`, and with
`checkpoint.keep_best = "METRIC"` the best one by an eval metric.

    iterations/<N+1>/metrics/eval.json --measures--> checkpoints/iter-<N>
        (iteration N+1 samples from, and evaluates, the model trained through N;
        iteration 0's eval measures the initial model, which is no checkpoint)

    phase 13 of N (master)
        best  = the best of the checkpoints present (K < N) whose eval is published
             -> checkpoints/best.json, published when it changes
        prune = every checkpoints/iter-<K> with K <= N - checkpoint.keep, but the best

    readers of best.json: `coordinator status` (rl/history.py, the checkpoint
    column) and `coordinator export --best` (rl/export.py)

The best is derived, never carried over: since the best is never pruned, the best
of the checkpoints still present is the best of every checkpoint evaluated while
keep_best was set.  A best.json that is malformed or names another metric is
therefore simply published again.

A metric is an eval.json key, written `eval/<key>` (TensorBoard's name) or
`<key>`: `eval/accuracy` and `eval/reward_mean` (higher is better),
`eval/num_failed` and `eval/reward_timeouts` (lower is better), or any other
number the eval metrics carry (a reward's own keys): lower is better for a
name ending in `loss` or `error` (Hugging Face Trainer's rule for
`metric_for_best_model`), higher otherwise; `:min` or `:max` after the name
says which way instead.  Ties keep the earlier checkpoint.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Final

from coordinator import routing
from coordinator.errors import MalformedRecordError, UsageError
from coordinator.records.records import Record
from coordinator.storage import fsio, trees
from coordinator.storage.store import read_document
from rl import layout

log = logging.getLogger(__name__)


class Better(str, enum.Enum):
    """Which way a metric improves."""

    HIGHER = "higher"
    LOWER = "lower"


# eval.json keys that measure the model, and which way is better.
KNOWN_METRICS: Final = {"accuracy": Better.HIGHER, "reward_mean": Better.HIGHER,
                        "num_failed": Better.LOWER, "reward_timeouts": Better.LOWER}
# eval.json keys that count the work done or describe the rollout, not the model.
NOT_METRICS: Final = frozenset({
    "iteration", "num_tasks", "num_samples", "num_train_samples", "num_dropped_groups",
    "policy_versions", "samples_per_second", "staleness_max", "staleness_mean",
    "stale_groups_dropped", "reward_calls"})
_KEY: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]{0,99}")
_CHECKPOINT_NAME: Final = re.compile(r"iter-(\d{6})")
EXAMPLE: Final = "eval/accuracy"


@dataclass(frozen=True)
class Metric:
    """An eval metric that chooses a checkpoint: its eval.json key and its direction."""

    key: str
    better: Better

    @property
    def name(self) -> str:
        return f"eval/{self.key}"

    def describe(self) -> str:
        return f"{self.name} ({self.better.value} is better)"

    def improves(self, value: float, on: float) -> bool:
        """Whether `value` is strictly better than `on`."""
        return value > on if self.better is Better.HIGHER else value < on

    def value_in(self, metrics: dict[str, object]) -> float | None:
        """The metric in an eval.json object: None when absent or not a finite number."""
        value = metrics.get(self.key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        return float(value) if math.isfinite(value) else None


def parse_metric(text: str, *, what: str) -> Metric:
    """`eval/<key>` or `<key>`, with `:min` or `:max` to say the direction; UsageError
    naming `what` (the setting or flag) otherwise."""
    name, sep, direction = text.strip().partition(":")
    key = name.removeprefix("eval/")
    where = name.split("/")[0]
    if "/" in name and where in ("rollout", "train", "phase_s"):
        raise UsageError(
            f"{what}={text!r} is a {where} metric: only an eval metric chooses a checkpoint "
            "(rollout and train metrics are measured on the prompts the model trains on, or "
            f"on the training itself): give e.g. {EXAMPLE}")
    if not _KEY.fullmatch(key) or key in NOT_METRICS:
        why = ("counts the eval's work, it does not measure the model" if key in NOT_METRICS
               else "is not an eval metric name (letters, digits, _ . / -)")
        raise UsageError(
            f"{what}={text!r} {why}: give an eval metric, e.g. {EXAMPLE} or eval/reward_mean "
            "(higher is better), eval/num_failed (lower is better), or your reward's own key "
            "with :max or :min")
    if sep:
        choice = {"max": Better.HIGHER, "min": Better.LOWER}.get(direction)
        if choice is None:
            raise UsageError(f"{what}={text!r}: after ':' give max (higher is better) or min "
                             f"(lower is better), e.g. {EXAMPLE}:max")
        return Metric(key, choice)
    if key in KNOWN_METRICS:
        return Metric(key, KNOWN_METRICS[key])
    lower = key.lower().endswith(("loss", "error"))
    return Metric(key, Better.LOWER if lower else Better.HIGHER)


@dataclass(frozen=True, kw_only=True)
class BestCheckpoint(Record):
    """checkpoints/best.json: the checkpoint kept as the best by `metric`."""

    SCHEMA: ClassVar[str] = "coordinator/best-checkpoint"
    metric: str  # eval/<key>
    better: Better
    iteration: int  # checkpoints/iter-<iteration>
    value: float
    evaluated_at: int  # the iteration whose metrics/eval.json measured it: iteration + 1

    def __post_init__(self) -> None:
        if type(self.iteration) is not int or not 0 <= self.iteration < 999_999:
            raise ValueError(f"iteration {self.iteration!r} is not a checkpoint's iteration")
        if self.evaluated_at != self.iteration + 1:
            raise ValueError(f"evaluated_at {self.evaluated_at!r} is not iteration + 1")
        if not math.isfinite(self.value):
            raise ValueError(f"value {self.value!r} is not a finite number")

    def chosen_by(self, metric: Metric) -> bool:
        return self.metric == metric.name and self.better is metric.better

    def describe(self) -> str:
        return (f"iter-{self.iteration:06d}: {self.metric} {self.value:.4g} "
                f"({self.better.value} is better; measured by iteration {self.evaluated_at})")


def present(run_dir: Path) -> list[int]:
    """The iterations of the checkpoint directories in checkpoints/, ascending (a
    listing: a hint, as everywhere; a directory not shown is handled next time)."""
    found = (_CHECKPOINT_NAME.fullmatch(name) for name in trees.listdir(layout.checkpoints(run_dir)))
    return sorted(int(m.group(1)) for m in found if m is not None)


def measured(run_dir: Path, iteration: int, metric: Metric, *,
             retry_s: float | None = None) -> float | None:
    """The metric of checkpoint `iteration`, from the eval of iteration + 1; None when
    that iteration did not evaluate (yet) or its metrics lack the key.  An unreadable
    eval.json is logged and counts as not evaluated."""
    path = layout.metrics(run_dir, iteration + 1, "eval")
    try:
        data = read_document(path, lambda raw, _where: json.loads(raw), retry_s=retry_s)
    except (OSError, ValueError) as exc:
        data = exc
    if data is not None and not isinstance(data, dict):
        log.warning("%s could not be read (%s): checkpoint iter-%06d is not a candidate for "
                    "the best by %s", routing.display(path), data, iteration, metric.name)
        return None
    return None if data is None else metric.value_in(data)


def best_of(run_dir: Path, iterations: Iterable[int], metric: Metric) -> BestCheckpoint | None:
    """The best of these checkpoints by `metric` (the earliest of equals); None when
    none of them was evaluated."""
    best: BestCheckpoint | None = None
    for k in sorted(iterations):
        value = measured(run_dir, k, metric)
        if value is not None and (best is None or metric.improves(value, best.value)):
            best = BestCheckpoint(metric=metric.name, better=metric.better, iteration=k,
                                  value=value, evaluated_at=k + 1)
    return best


def read_record(run_dir: Path, *, retry_s: float | None = None) -> BestCheckpoint | None:
    """checkpoints/best.json; None when absent.  MalformedRecordError names a bad one
    (after `retry_s` of reading again: None, coordination.read_retry_s)."""
    return read_document(layout.best_checkpoint(run_dir), BestCheckpoint.from_bytes,
                         retry_s=retry_s)


def record_best(run_dir: Path, iteration: int, metric: Metric, *,
                present: Sequence[int]) -> BestCheckpoint | None:
    """Phase 13 of `iteration` (master): the best of the checkpoints `present`, published
    to checkpoints/best.json when it differs from what is there."""
    best = best_of(run_dir, (k for k in present if k < iteration), metric)
    if best is None:
        return None
    try:
        current = read_record(run_dir)
    except MalformedRecordError as exc:
        log.warning("%s: publishing it again", exc)
        current = None
    if current != best:
        fsio.publish_bytes(layout.best_checkpoint(run_dir), best.to_bytes())
        log.info("iteration %d: the best checkpoint is now %s (checkpoint.keep_best)",
                 iteration, best.describe())
    return best


def prunable(checkpoints: Sequence[int], *, iteration: int, keep: int,
             best: int | None) -> list[int]:
    """The checkpoints phase 13 of `iteration` removes: those beyond the newest
    `keep` (K <= iteration - keep), never `best`; newest first."""
    return sorted((k for k in checkpoints if k <= iteration - keep and k != best), reverse=True)


# `coordinator status` is interactive: one second for best.json, then not shown.
STATUS_READ_S: Final = 1.0


def checkpoint_states(run_dir: Path) -> dict[int, str]:
    """For `coordinator status` (its reads give up after STATUS_READ_S): each checkpoint present, "kept", or "best (<value>)"
    for the one best.json names.  A best.json that does not parse is not shown."""
    states = {k: "kept" for k in present(run_dir)}
    try:
        best = read_record(run_dir, retry_s=STATUS_READ_S)
    except MalformedRecordError as exc:
        log.warning("%s", exc)
        best = None
    if best is not None and best.iteration in states:
        states[best.iteration] = f"best ({best.value:.4g})"
    return states
